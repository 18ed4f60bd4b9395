"""Which part of an assistant turn a generated token belongs to: reasoning, content or tool call.

Driven by the marker tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`); a marker
counts toward the segment it opens or closes. Models without these tokens stay in "content".
"""

from __future__ import annotations

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"
SEGMENTS = (REASONING, CONTENT, TOOL_CALL)


def token_id(tokenizer, token: str) -> int | None:
    """The id of one vocabulary entry, or None. Asked token by token: a real tokenizer's
    `get_vocab()` builds a dict of the whole vocabulary (~200 ms for Qwen3's 151k entries), and
    a tracker is made for every request."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found < 0:
        return None
    return found if tokenizer.convert_ids_to_tokens(found) == token else None  # not an unknown-token stand-in


class SegmentTracker:
    def __init__(self, tokenizer, start_in_reasoning: bool = False):
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
