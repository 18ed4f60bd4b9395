"""Splitting streamed model text into reasoning, content and tool calls, as it arrives.

Tags can straddle two text chunks, so a tail that could be the start of a tag is held back until
the next chunk decides it. A tool call is released whole, once its closing tag arrives (or the
output ends, for formats without one), parsed by the model's tool-call format
(`mtplx/tool_formats.py`; the `<tool_call>` family by default, JSON or Qwen3.5 XML bodies alike).
An unparseable call is released as content, never dropped.

The engine runs one stream per request (engine/generation.py): each Tokens event carries the
pieces its text completes and Finished carries all of them with `message(pieces)`, so the server,
receipts, bank and TUI read the split instead of parsing the text again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.tool_formats import TAGGED, ToolFormat

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)


@dataclass(frozen=True)
class Piece:
    kind: str  # "reasoning", "content" or "tool_call"
    text: str = ""
    name: str | None = None  # tool calls only
    arguments: str | None = None  # tool calls only: a JSON object as a string


class SegmentText:
    """One segment's text as pieces: whitespace right after a tag is markup (dropped); trailing
    whitespace is held until more text follows in the same segment (so none ends a segment)."""

    def __init__(self, fresh: bool):
        self.fresh, self.held = fresh, ""

    def restart(self) -> None:
        """A tag began a new segment."""
        self.fresh, self.held = True, ""

    def take(self, kind: str, text: str) -> Piece | None:
        if self.fresh:
            text = text.lstrip()
            if not text:
                return None
            self.fresh = False
        body = text.rstrip()
        if not body:
            self.held += text
            return None
        piece, self.held = Piece(kind, self.held + body), text[len(body):]
        return piece


class ReplyStream:
    def __init__(self, in_reasoning: bool = False, tool_format: ToolFormat | None = None, tools: list | None = None,
                 calls: bool = True):
        """`tool_format`: the model's (Checkpoint.tool_format), default the `<tool_call>` family;
        `tools`: the request's tool schemas, which type XML parameter values; `calls` False: no
        call is read (tool_choice none), its text is content."""
        self.format = tool_format or TAGGED
        self.tools = tools
        self.open, self.close = (self.format.start, self.format.end) if calls else ("", "")
        self.tags = tuple(t for t in (THINK_OPEN, THINK_CLOSE, self.open, self.close) if t)
        self._firsts = {t[0] for t in self.tags}
        self.mode = "reasoning" if in_reasoning else "content"
        self.buffer = ""
        self.call = ""
        # At the start of a segment after a tag, leading whitespace is markup, not text. A reply
        # that opens with content keeps its leading whitespace: it is what the model wrote, and a
        # client sending it back then renders the reply exactly as generated (reply_ids.py), where
        # a dropped leading newline made the whole reply differ from the model's own tokens.
        self.segment_text = SegmentText(fresh=in_reasoning)
        # A format whose call is the reply itself (Llama's bare JSON): until the reply's first
        # visible character says whether it opens a call ("{"), its leading whitespace waits.
        self.undecided = calls and self.format.body == "bare" and not in_reasoning
        self.bare_call = False  # the call being read opened with "{", not with the format's tag

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self.buffer:
            if self.mode == "tool_call" and not self.close:  # the call runs to the end of the output
                self.call += self.buffer
                self.buffer = ""
                break
            tag_at, tag = min(((self.buffer.find(t), t) for t in self.tags if t in self.buffer), default=(-1, None))
            if tag is None:
                keep = 0 if final else self._partial_tag_tail()
                self._emit(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            self._emit(out, self.buffer[:tag_at])
            self.buffer = self.buffer[tag_at + len(tag) :]
            self._switch(tag, out)
        if final and self.mode == "tool_call":
            if not self.close:
                out.extend(self._parse_call(self.call))
            elif self.call:
                out.append(Piece("content", self.open + self.call))  # never closed: show it as text
            self.call, self.mode = "", "content"
        return [p for p in out if p.text or p.kind == "tool_call"]

    def _partial_tag_tail(self) -> int:
        """How many characters at the buffer's end may still grow into a tag (held back)."""
        longest = max(map(len, self.tags)) - 1
        tail = self.buffer[-longest:]
        # Only a tail that starts with a tag's first character can be one's beginning: most pieces
        # of text have none, and this runs for every token of every row (a batch's per-row cost).
        if not any(c in tail for c in self._firsts):
            return 0
        for n in range(min(len(self.buffer), longest), 0, -1):
            if any(t.startswith(self.buffer[-n:]) for t in self.tags):
                return n
        return 0

    def _emit(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self.mode == "tool_call":
            self.call += text
            return
        if self.undecided and self.mode == "content":
            if not text.strip():
                self.segment_text.held += text
                return
            self.undecided = False
            if text.lstrip().startswith("{"):  # the reply is a call; it runs to the end of the output
                self.mode, self.call, self.bare_call, self.segment_text.held = "tool_call", text.lstrip(), True, ""
                return
        if piece := self.segment_text.take(self.mode, text):
            out.append(piece)

    def _switch(self, tag: str, out: list[Piece]) -> None:
        self.segment_text.restart()
        if tag == THINK_OPEN:
            self.mode = "reasoning"
        elif tag == THINK_CLOSE:
            self.mode = "content"
        elif tag == self.open:
            self.mode, self.call, self.undecided = "tool_call", "", False
        elif tag == self.close and self.mode == "tool_call":
            out.extend(self._parse_call(self.call))
            self.mode, self.call = "content", ""

    def _parse_call(self, body: str) -> list[Piece]:
        try:
            calls = self.format.parse(body, self.tools)
        except Exception:  # any parser failure (json, regex, a delegated parser's own) shows the text
            return [Piece("content", body if self.bare_call else self.open + body + self.close)]
        return [Piece("tool_call", name=c.name, arguments=self.format.arguments_json(c)) for c in calls]


def message(pieces) -> dict:
    """The assistant message a reply's pieces make: what an OpenAI client sends back in its next
    request (content, reasoning_content when there was reasoning, tool_calls when there were any)."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
             for i, p in enumerate(p for p in pieces if p.kind == "tool_call")]
    out = {"role": "assistant", "content": content}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = calls
    return out
