"""gpt-oss replies (OpenAI's harmony format), split into reasoning, content and tool calls.

A harmony reply is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>answer`
(the prompt ends with `<|start|>assistant`; the reply ends at `<|return|>` or, after a call,
`<|call|>`, both end-of-sequence tokens). The header names the channel (analysis: reasoning;
final: the answer; commentary: a preamble the user sees, or a tool call) and, for a call, its
recipient, in the role part or after the channel:
`<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{...}`.
Every one of these tokens is special in gpt-oss's vocabulary, so the reply's text keeps them
(engine/text_stream.py keeps `MARKUP`), and this stream reads the text as it arrives, with the
interface of reply_stream.ReplyStream: pieces out, a tool call released whole when its message ends.

This module knows text and JSON, never tokens or requests.
"""

from __future__ import annotations

import json
import re

from mtplx.reply_stream import Piece, SegmentText

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
# kept in the reply's text; <|call|> and <|return|> end the sequence, so they never reach it
MARKUP = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
_ENDS = (END, CALL, RETURN, START)  # a message's body ends at any of these (or at the end of the reply)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def is_harmony(tokenizer) -> bool:
    """Whether the vocabulary has harmony's markup tokens (gpt-oss and its conversions)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return all(t in vocab for t in (START, CHANNEL, MESSAGE, END))


def kind_of(header: str) -> tuple[str, str | None]:
    """A message's kind ("reasoning", "content" or "tool_call") and its tool's name, from its header."""
    recipient = _RECIPIENT.search(header)
    if recipient and recipient.group(1) != "assistant":
        name = recipient.group(1)
        return "tool_call", name[len("functions."):] if name.startswith("functions.") else name
    channel = _CHANNEL.search(header)
    if channel and channel.group(1) == "analysis":
        return "reasoning", None
    return "content", None


class HarmonyReply:
    """Splits a harmony reply's text, fed as it is decoded, into pieces."""

    def __init__(self, tools: list | None = None, calls: bool = True):
        """`calls` False (tool_choice none): a message to a tool is shown as content, not read as a call."""
        self.tools, self.calls = tools, calls
        self.mode = "header"  # the reply starts right after the prompt's `<|start|>assistant`
        self.header = ""
        self.kind, self.name = "content", None
        self.body = ""  # a tool call's arguments, held until its message ends
        self.buffer = ""
        self.segment_text = SegmentText(fresh=True)

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self.buffer:
            tags = (MESSAGE,) if self.mode == "header" else _ENDS
            found = [(at, tag) for tag in tags if (at := self.buffer.find(tag)) != -1]
            if not found:
                keep = 0 if final else _partial_tail(self.buffer, tags)
                self._take(self.buffer[: len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            at, tag = min(found)
            self._take(self.buffer[:at], out)
            self.buffer = self.buffer[at + len(tag):]
            if self.mode == "header":
                self.kind, self.name = kind_of(self.header)
                self.mode, self.header, self.body = "body", "", ""
                self.segment_text.restart()
            else:
                self._end_message(out)
        if self.mode == "header" and (final or len(self.header) > HEADER_MAX) and _plain(self.header):
            # Text with no harmony header (a model that left the format): shown as content, never dropped.
            self.mode, self.kind, self.name = "body", "content", None
            self.segment_text.restart()
            text, self.header = self.header, ""
            self._take(text, out)
        if final and self.mode == "body":
            self._end_message(out)
        return [p for p in out if p.text or p.kind == "tool_call"]

    def _take(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.mode == "header":
            self.header += text
            return
        if self.kind == "tool_call":
            self.body += text
            return
        if piece := self.segment_text.take(self.kind, text):
            out.append(piece)

    def _end_message(self, out: list[Piece]) -> None:
        if self.kind == "tool_call":
            out.append(self._call() if self.calls else Piece("content", f"to={self.name}: {self.body.strip()}"))
        self.mode, self.header, self.body = "header", "", ""

    def _call(self) -> Piece:
        text = self.body.strip()
        try:
            args = json.loads(text)
        except ValueError:
            args = None
        if not isinstance(args, dict):  # not a call a client can run: show it, never drop it
            return Piece("content", f"to={self.name}: {text}")
        return Piece("tool_call", name=self.name, arguments=json.dumps(args, ensure_ascii=False))


HEADER_MAX = 256  # a header is a role, a channel, a recipient and a content type: never this long


def _plain(header: str) -> bool:
    """Whether an unfinished header is text rather than markup: it names no channel and has
    more than a role word in it."""
    return CHANNEL not in header and CONSTRAIN not in header and header.strip() not in ("", "assistant")


def _partial_tail(text: str, tags: tuple[str, ...]) -> int:
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def visible_mask(text: str, hidden: str) -> str:
    """`text` with everything but the answer's own text (final and preamble bodies) replaced by
    `hidden`, character for character: what stop strings may match."""
    out, i, mode, kind, header = [], 0, "header", "content", ""
    while i < len(text):
        tags = (MESSAGE,) if mode == "header" else _ENDS
        found = [(at, tag) for tag in tags if (at := text.find(tag, i)) != -1]
        at, tag = min(found) if found else (len(text), None)
        span = text[i:at]
        if mode == "body" and kind == "content":
            body = span.lstrip()  # a body's leading whitespace is markup, as the reply's pieces drop it
            out.append(hidden * (len(span) - len(body)) + body)
        else:
            header += span if mode == "header" else ""
            out.append(hidden * len(span))
        if tag is None:
            break
        out.append(hidden * len(tag))
        i = at + len(tag)
        if mode == "header":
            kind, _ = kind_of(header)
            mode, header = "body", ""
        else:
            mode = "header"
    return "".join(out)


class HarmonySegments:
    """Which part of the reply each generated token belongs to, for acceptance by segment: a
    message's header tokens count with the message before them; its `<|message|>` token and its
    body with its own kind."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.message = vocab.get(MESSAGE)
        self.ends = {vocab[t] for t in (END, CALL, RETURN, START) if t in vocab}
        self.current = "content"
        self.header: list[int] | None = []  # a header's tokens while one is open

    def segment_of(self, token: int) -> str:
        if self.header is not None:
            if token == self.message:
                self.current = kind_of(self.tokenizer.decode(self.header))[0]
                self.header = None
            else:
                self.header.append(token)
            return self.current
        if token in self.ends:
            self.header = []
        return self.current

    def peek(self, token: int) -> str:
        return self.current
