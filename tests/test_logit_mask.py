"""A history-free rule as one vector added to logits (mtplx/engine/logit_mask.py): the same
values as the rule itself, and the same rule over the draft vocabulary."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.logit_bias import LogitBias
from mtplx.engine.logit_mask import LogitMask
from mtplx.engine.rule_set import RuleSet
from mtplx.engine.tool_rule import ToolRule

OPEN = 7


@pytest.mark.parametrize("rule", [ToolRule("never", OPEN), LogitBias([(3, 2.5), (OPEN, -1.0), (40, -100.0)]),
                                  RuleSet((ToolRule("never", OPEN), LogitBias([(3, 2.5), (OPEN, 4.0)])))],
                         ids=["never", "bias", "never+bias"])
def test_the_vector_gives_what_the_rule_gives(rule):
    logits = mx.random.normal((2, 3, 64), key=mx.random.key(1)) * 5
    logits[0, 0, 9] = -0.0
    want, got = np.array(rule.apply(logits, ())), np.array(LogitMask(rule)(logits))
    assert np.array_equal(want, got)  # -0.0 + 0.0 is +0.0: equal as values, as argmax and softmax see them


def test_over_the_draft_vocabulary_it_is_the_rule_at_those_ids():
    class Runner:  # what on_drafts reads of a ModelRunner
        vocab_rows = 64
        draft_ids = mx.array([1, 3, OPEN, 20], dtype=mx.uint32)

    rule = RuleSet((ToolRule("never", OPEN), LogitBias([(3, 2.5)])))
    mask = LogitMask(rule)
    full = mx.random.normal((64,), key=mx.random.key(2))
    part = full[Runner.draft_ids]
    assert np.array_equal(np.array(mask.on_drafts(part, Runner)), np.array(rule.apply(full, ())[Runner.draft_ids]))
    Runner.draft_ids = None  # drafting from the whole vocabulary
    assert np.array_equal(np.array(mask.on_drafts(full, Runner)), np.array(rule.apply(full, ())))


def test_only_a_history_free_rule_is_a_vector():
    with pytest.raises(ValueError):
        LogitMask(ToolRule("required", OPEN))
