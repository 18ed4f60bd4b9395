"""A cap on the reply's reasoning (Anthropic's `thinking.budget_tokens`), on the logits.

Once the reasoning block holds `budget` tokens, its closing token is forced, and the reply goes on
as visible text. Like every rule it applies at each position the generation loop samples (AR
picks, MTP drafts, verify rows), so MTP under a budget keeps exactly what AR under it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from mtplx.engine.tool_rule import content_start


@dataclass(frozen=True)
class ReasoningBudget:
    budget: int
    think: tuple[int, int]  # the reasoning block's open and close tokens
    starts_in_reasoning: bool = False  # the prompt ends inside an open reasoning block

    def __post_init__(self):
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
            raise ValueError(f"a reasoning budget must be a positive integer, got {self.budget!r}")

    history_free = False  # whether to close depends on how much reasoning came before

    def apply(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if content_start(history, self.think, self.starts_in_reasoning) is not None:
            return logits  # no reasoning, or it has closed
        used = len(history) - (1 if history and history[0] == self.think[0] else 0)
        if used < self.budget:
            return logits
        forced = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
        forced[..., self.think[1]] = 0.0
        return forced
