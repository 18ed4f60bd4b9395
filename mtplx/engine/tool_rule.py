"""Whether a request may, or must, call a tool — enforced on the logits, not by filtering text.

A rule knows token ids only (the tool-call opening token, the end-of-turn tokens, the tokens of a
named tool's call head), never text or templates. `apply` transforms one position's logits given
the tokens generated before it; the generation loop applies it at every position it samples —
autoregressive picks, MTP drafts and every row of a verify — so MTP under a rule stays exactly
the autoregressive result under that rule.

- "never": the opening token cannot be sampled (no tools, or tool_choice none).
- "free": any reply, except as `single_close` says (below).
- "required": until a call has been opened, the probability of ending the turn moves onto the
  opening token; reasoning stays free, but once the visible reply starts (after the reasoning's
  closing token, or at once without reasoning) only blank tokens may come first and then the
  opening token is forced (the model calls a tool instead of answering); once opened, a named
  tool's call head is forced token by token.

With `single_close` (the call-closing token; parallel tool calls off), once a call has closed the
opening token cannot be sampled again: one call a reply, then the model ends or writes text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

MODES = ("never", "free", "required")


@dataclass(frozen=True)
class ToolRule:
    mode: str
    call_open: int
    end_ids: tuple[int, ...] = ()
    head: tuple[int, ...] = ()  # forced right after the opening token (a named tool), "required" only
    think: tuple[int, int] | None = None  # the reasoning open/close tokens, when the template has them
    starts_in_reasoning: bool = False  # the prompt ends inside an open reasoning block
    blank: tuple[int, ...] = ()  # whitespace-only tokens allowed before a forced call
    single_close: int | None = None  # the call-closing token, when only one call may be made

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"tool rule mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.call_open, int) or self.call_open < 0:
            raise ValueError(f"call_open must be a token id, got {self.call_open!r}")

    @property
    def history_free(self) -> bool:
        """The same transform at every position whatever came before it ("never"): it can shape a
        lazy chain of drafts and every row of a verify at once, with no host round trip."""
        return self.mode == "never"

    def apply(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """The logits of one position (last axis = vocabulary) after the rule."""
        if self.mode == "never":
            return _set(logits, [self.call_open], -mx.inf)
        opened = _index(history, self.call_open)
        if self.single_close is not None and opened is not None and self.single_close in list(history)[opened:]:
            return _set(logits, [self.call_open], -mx.inf)  # one call made: no second one
        if self.mode == "free":
            return logits
        if opened is None:
            ends = [e for e in self.end_ids if e != self.call_open]
            if not ends:
                return logits
            # p'(open) = p(open) + p(ends): the same distribution with ending renamed to calling.
            merged = mx.logsumexp(mx.stack([logits[..., self.call_open]] + [logits[..., e] for e in ends]), axis=0)
            logits = _set(_set(logits, ends, -mx.inf), [self.call_open], merged)
            start = self._content_start(history)
            if start is None:  # still reasoning
                return logits
            n = len(history) - start
            allowed = [self.call_open]
            if n < 2:
                allowed += list(self.blank)
                if not history and self.think is not None and not self.starts_in_reasoning:
                    allowed.append(self.think[0])  # the model may open its reasoning first
            return _keep(logits, allowed)
        step = len(history) - opened - 1
        if step < len(self.head):
            forced = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
            return _set(forced, [self.head[step]], 0.0)
        return logits


    def _content_start(self, history: Sequence[int]) -> int | None:
        return content_start(history, self.think, self.starts_in_reasoning)


def content_start(history: Sequence[int], think: tuple[int, int] | None, starts_in_reasoning: bool) -> int | None:
    """Where the visible reply starts in `history` (a reply's tokens), or None while reasoning."""
    if think is None:
        return 0
    close = _index(history, think[1])
    if close is not None:
        return close + 1
    if starts_in_reasoning or (history and history[0] == think[0]):
        return None
    return 0


def _index(history: Sequence[int], token: int) -> int | None:
    try:
        return list(history).index(token)
    except ValueError:
        return None


def _set(logits: mx.array, ids: list[int], value) -> mx.array:
    out = mx.array(logits)
    for i in ids:
        out[..., i] = value
    return out


def _keep(logits: mx.array, ids: list[int]) -> mx.array:
    mask = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
    mask[mx.array(ids)] = True
    return mx.where(mask, logits, -mx.inf)
