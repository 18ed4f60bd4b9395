"""A request's rules on the logits applied as one, in order (each gets the previous one's logits).

Tool rule, logit bias, output schema, tool-call grammar, reasoning budget: a position's logits pass through each. The set is
history-free only when every rule is, so a bias alone keeps greedy drafts in the lazy chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx


@dataclass(frozen=True)
class RuleSet:
    rules: tuple

    @property
    def history_free(self) -> bool:
        return all(r.history_free for r in self.rules)

    def apply(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        for rule in self.rules:
            logits = rule.apply(logits, history)
        return logits


def rules_of(request):
    """The request's rules as one (None: free). A call the reply must make is the whole reply, so
    "required" leaves no room for a schema. The bias comes before the schema, so the schema's
    mask has the last word."""
    tool, output = request.tool_rule, request.output_rule
    if tool is not None and tool.mode == "required":
        output = None
    bias = None
    if request.sampling.logit_bias:
        from mtplx.engine.logit_bias import LogitBias

        bias = LogitBias(request.sampling.logit_bias)
    # The reasoning budget last: when it closes the reasoning, nothing may reopen the choice.
    rules = tuple(r for r in (tool, bias, output, request.call_rule, request.reasoning_rule) if r is not None)
    return None if not rules else rules[0] if len(rules) == 1 else RuleSet(rules)
