"""Anthropic's thinking.budget_tokens: the reasoning is closed on the logits once it holds that many
tokens, MTP under the budget equal to AR under it, and the server's mapping."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest

from mtplx.chat import render
from mtplx.engine.reasoning_budget import ReasoningBudget
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams

OPEN, CLOSE = 3, 4


def test_the_reasoning_is_closed_once_it_holds_the_budget():
    logits = mx.zeros((8,))
    rule = ReasoningBudget(2, (OPEN, CLOSE))
    assert mx.argmax(rule.apply(logits, [OPEN, 0, 1])).item() == CLOSE
    assert rule.apply(logits, [OPEN, 0, 1])[0].item() == float("-inf")
    assert rule.apply(logits, [OPEN, 0]).tolist() == logits.tolist()  # under the budget
    assert rule.apply(logits, [OPEN, 0, 1, CLOSE, 5, 6]).tolist() == logits.tolist()  # closed: free
    assert rule.apply(logits, [0, 1, 2]).tolist() == logits.tolist()  # no reasoning opened
    inside = ReasoningBudget(2, (OPEN, CLOSE), starts_in_reasoning=True)  # the prompt opened it
    assert mx.argmax(inside.apply(logits, [0, 1])).item() == CLOSE
    with pytest.raises(ValueError):
        ReasoningBudget(0, (OPEN, CLOSE))


def _reasoning_prompt(tokenizer):
    return tuple(render(tokenizer, [{"role": "user", "content": "Fix the failing test in tests/test_cp852.py"}], None,
                        enable_thinking=True))


def test_mtp_greedy_equals_ar_greedy_under_a_budget(engine, tokenizer):
    prompt = _reasoning_prompt(tokenizer)
    think = (tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>"))
    free = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60), use_mtp=False)).result()
    budget = 6
    assert free.stats.tokens_by_segment["reasoning"] > budget + 2  # the budget bites
    capped = [engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60), use_mtp=mtp, depth=3,
                                              reasoning_rule=ReasoningBudget(budget, think))).result()
              for mtp in (False, True)]
    assert capped[0].token_ids == capped[1].token_ids and capped[1].stats.verify_calls > 0
    ids = list(capped[0].token_ids)
    assert ids[0] == think[0] and ids.index(think[1]) == budget + 1  # <think>, the budget, </think>
    assert len(ids) > budget + 2  # and the reply goes on after it


@pytest.fixture(scope="module")
def url(tiny_dense_url):
    return tiny_dense_url


def test_anthropic_budget_tokens_caps_the_thinking_block(url):
    ask = {"model": "m", "max_tokens": 60, "temperature": 0,
           "messages": [{"role": "user", "content": "Fix the failing test in tests/test_cp852.py"}]}
    free = httpx.post(url + "/v1/messages", json={**ask, "thinking": {"type": "enabled"}}, timeout=60).json()
    capped = httpx.post(url + "/v1/messages", json={**ask, "thinking": {"type": "enabled", "budget_tokens": 6}},
                        timeout=60).json()
    blocks = {b["type"]: b for b in capped["content"]}
    assert len(blocks["thinking"]["thinking"]) < len(free["content"][0]["thinking"]) and blocks["text"]["text"]
    for budget in (0, "8", True):
        bad = httpx.post(url + "/v1/messages", json={**ask, "thinking": {"type": "enabled", "budget_tokens": budget}})
        assert bad.status_code == 400 and "budget_tokens" in bad.json()["error"]["message"]
