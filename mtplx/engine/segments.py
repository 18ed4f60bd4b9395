"""Which part of an assistant turn a generated token belongs to: reasoning, content or tool call.

Driven by the marker tokens (`<think>`, `</think>`, and the model's tool-call delimiters:
`<tool_call>`, `</tool_call>` by default); a marker counts toward the segment it opens or closes. Models without these tokens stay in "content".
"""

from __future__ import annotations

from mtplx.vocab import token_id

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"
SEGMENTS = (REASONING, CONTENT, TOOL_CALL)


class SegmentTracker:
    def __init__(self, tokenizer, start_in_reasoning: bool = False, call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>")):
        # One lookup per marker: a tracker is made for every request (see vocab.token_id).
        call_open, call_close = call_tags
        ids = {m: token_id(tokenizer, m) if m else None for m in ("<think>", call_open, "</think>", call_close)}
        self.opens = {ids[m]: seg for m, seg in (("<think>", REASONING), (call_open, TOOL_CALL)) if ids[m] is not None}
        self.closes = {ids[m] for m in ("</think>", call_close) if ids[m] is not None}
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
