"""Splitting streamed model text into reasoning, content and tool calls, as it arrives.

Tags can straddle two text chunks, so a tail that could be the start of a tag is held back until
the next chunk decides it. A tool call is released whole, once its closing tag arrives, with its
JSON parsed (an unparseable call is released as content, never dropped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)


@dataclass(frozen=True)
class Piece:
    kind: str  # "reasoning", "content" or "tool_call"
    text: str = ""
    name: str | None = None  # tool calls only
    arguments: str | None = None  # tool calls only: a JSON object as a string


class ReplyStream:
    def __init__(self, in_reasoning: bool = False):
        self.mode = "reasoning" if in_reasoning else "content"
        self.buffer = ""
        self.call = ""
        self.tool_calls = 0
        self.fresh = True  # at the start of a segment: leading whitespace is markup, not text
        self.held_ws = ""  # trailing whitespace, released only if more text follows in this segment

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self.buffer:
            tag_at, tag = min(((self.buffer.find(t), t) for t in TAGS if t in self.buffer), default=(-1, None))
            if tag is None:
                keep = 0 if final else self._partial_tag_tail()
                self._emit(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            self._emit(out, self.buffer[:tag_at])
            self.buffer = self.buffer[tag_at + len(tag) :]
            self._switch(tag, out)
        if final and self.mode == "tool_call" and self.call:
            out.append(Piece("content", CALL_OPEN + self.call))  # never closed: show it as text
            self.call, self.mode = "", "content"
        return [p for p in out if p.text or p.kind == "tool_call"]

    def _partial_tag_tail(self) -> int:
        for n in range(min(len(self.buffer), max(map(len, TAGS)) - 1), 0, -1):
            if any(t.startswith(self.buffer[-n:]) for t in TAGS):
                return n
        return 0

    def _emit(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self.mode == "tool_call":
            self.call += text
            return
        if self.fresh:
            text = text.lstrip()
            if not text:
                return
            self.fresh = False
        body = text.rstrip()
        if not body:
            self.held_ws += text
            return
        out.append(Piece(self.mode, self.held_ws + body))
        self.held_ws = text[len(body):]

    def _switch(self, tag: str, out: list[Piece]) -> None:
        self.fresh, self.held_ws = True, ""
        if tag == THINK_OPEN:
            self.mode = "reasoning"
        elif tag == THINK_CLOSE:
            self.mode = "content"
        elif tag == CALL_OPEN:
            self.mode, self.call = "tool_call", ""
        elif tag == CALL_CLOSE and self.mode == "tool_call":
            out.append(self._parse_call(self.call))
            self.mode, self.call = "content", ""

    def _parse_call(self, body: str) -> Piece:
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name")
        except (json.JSONDecodeError, KeyError, TypeError):
            return Piece("content", CALL_OPEN + body + CALL_CLOSE)
        self.tool_calls += 1
        return Piece("tool_call", name=name, arguments=args if isinstance(args, str) else json.dumps(args))
