"""Which part of an assistant turn a generated token belongs to: reasoning, content or tool call.

Driven by the marker tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`); a marker
counts toward the segment it opens or closes. Models without these tokens stay in "content".
"""

from __future__ import annotations

from mtplx.vocab import token_id

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"
SEGMENTS = (REASONING, CONTENT, TOOL_CALL)


class SegmentTracker:
    def __init__(self, tokenizer, start_in_reasoning: bool = False):
        # One lookup per marker: a tracker is made for every request (see vocab.token_id).
        ids = {m: token_id(tokenizer, m) for m in ("<think>", "<tool_call>", "</think>", "</tool_call>")}
        self.opens = {ids[m]: seg for m, seg in (("<think>", REASONING), ("<tool_call>", TOOL_CALL)) if ids[m] is not None}
        self.closes = {ids[m] for m in ("</think>", "</tool_call>") if ids[m] is not None}
        self.current = REASONING if start_in_reasoning else CONTENT

    def segment_of(self, token: int) -> str:
        """The segment `token` belongs to; advances the state past it."""
        if token in self.opens:
            self.current = self.opens[token]
            return self.current
        if token in self.closes:
            segment, self.current = self.current, CONTENT
            return segment
        return self.current

    def peek(self, token: int) -> str:
        """The segment `token` would belong to, without advancing."""
        if token in self.opens:
            return self.opens[token]
        return self.current
