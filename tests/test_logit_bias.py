"""OpenAI's logit_bias: added to the chosen tokens' logits at every position, MTP under it equal
to AR under it, and the server's checks."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest

from mtplx.chat import render
from mtplx.engine.logit_bias import LogitBias
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.errors import RequestError


def test_the_bias_is_added_to_its_tokens_only():
    out = LogitBias([(1, -100.0), (3, 2.5)]).apply(mx.zeros((2, 5)))
    assert out.tolist() == [[0, -100, 0, 2.5, 0]] * 2


def test_the_bias_is_checked():
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))


def test_mtp_greedy_equals_ar_greedy_under_a_bias(engine, tokenizer):
    prompt = tuple(render(tokenizer, [{"role": "user", "content": "Explain what src/ledger/events.py does"}], None))
    free = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=40), use_mtp=False)).result().token_ids
    # Ban the tokens the free reply leans on most, so the biased reply must differ.
    banned = sorted(set(free[2:12]) - set(engine.eos_ids))[:4]
    bias = SamplingParams(max_tokens=40, logit_bias=tuple((t, -100.0) for t in banned))
    runs = [engine.submit(GenerationRequest(prompt, bias, use_mtp=mtp, depth=3)).result() for mtp in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids != free
    assert runs[1].stats.verify_calls > 0 and not set(runs[0].token_ids) & set(banned)


@pytest.fixture(scope="module")
def url(tiny_dense_url):
    return tiny_dense_url


def test_the_server_takes_a_bias_on_chat_and_completions(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    free = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]["message"]
    forced = httpx.post(url + "/v1/chat/completions", json={**chat, "logit_bias": {"97": 100}, "enable_thinking": False},
                        timeout=60)
    assert forced.status_code == 200, forced.text
    text = forced.json()["choices"][0]["message"]["content"]
    assert text != free.get("content") and len(set(text.strip())) <= 2  # one token, over and over
    done = httpx.post(url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 4, "temperature": 0,
                                                     "logit_bias": {"97": 100}}, timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
