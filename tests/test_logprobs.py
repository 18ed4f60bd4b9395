"""Log-probabilities: each token's, from the step that drew or kept it (an AR step, an MTP verify
row), checked against a plain forward; the OpenAI chat and completions shapes; the events' round
trip."""

from __future__ import annotations

import math

import httpx
import mlx.core as mx
import pytest

from mtplx.chat import render
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.events import Finished, event_dict, event_from_dict


def _prompt(tokenizer, text="Explain what src/ledger/events.py does"):
    return tuple(render(tokenizer, [{"role": "user", "content": text}], None))


@pytest.mark.parametrize("use_mtp", [False, True])
def test_each_token_gets_the_log_probability_a_plain_forward_gives(dense_engine, tokenizer, use_mtp):
    from mtplx.catalog import resolve
    from mtplx.engine.checkpoint import load_trunk

    prompt = _prompt(tokenizer)
    fin = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=24, logprobs=3), use_mtp=use_mtp,
                                                depth=3)).result()
    assert fin.stats.mode == ("mtp" if use_mtp else "ar") and (fin.stats.verify_calls > 0) == use_mtp
    assert [e.token for e in fin.logprobs] == list(fin.token_ids)
    model = load_trunk(resolve("tiny-dense")).model  # mlx-lm's own forward, apart from the engine
    model.set_dtype(mx.float32)
    logits = model(mx.array([list(prompt) + list(fin.token_ids)]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, entry in enumerate(fin.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert abs(entry.logprob - row[entry.token].item()) < 2e-3
        assert entry.top[0][0] == entry.token and len(entry.top) == 3  # greedy: the drawn token is the likeliest
        assert [t for t, _, _ in entry.top] == mx.argsort(-row)[:3].tolist()
        assert sum(math.exp(lp) for _, _, lp in entry.top) <= 1 + 1e-5


def test_a_scored_prompt_gets_what_a_plain_forward_gives(dense_engine, tokenizer, monkeypatch):
    """request.prompt_logprobs: prompt token j's log-probability given tokens < j and its n best
    alternatives, likeliest first, over 64-token prefill chunks cut into 16-position logits blocks."""
    from mtplx.catalog import resolve
    from mtplx.engine import generation
    from mtplx.engine.checkpoint import load_trunk

    monkeypatch.setattr(generation, "SCORE_BLOCK", 16)
    prompt = _prompt(tokenizer, "Explain what src/ledger/events.py does and how the replay uses it. " * 4)
    fin = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2), prompt_logprobs=3)).result()
    assert len(prompt) > 64 and [e.token for e in fin.prompt_logprobs] == list(prompt[1:])
    model = load_trunk(resolve("tiny-dense")).model
    model.set_dtype(mx.float32)
    logits = model(mx.array([list(prompt)]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for j, entry in enumerate(fin.prompt_logprobs):
        assert abs(entry.logprob - logp[j, entry.token].item()) < 2e-3
        assert [t for t, _, _ in entry.top] == mx.argsort(-logp[j])[:3].tolist()
    plain = dense_engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2))).result()
    assert plain.prompt_logprobs == () and plain.token_ids == fin.token_ids


def test_mtp_with_log_probabilities_keeps_the_ar_tokens(engine, tokenizer):
    prompt = _prompt(tokenizer)
    plain = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=40), use_mtp=False)).result()
    asked = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=40, logprobs=0), use_mtp=True)).result()
    assert plain.token_ids == asked.token_ids and asked.stats.verify_calls > 0
    assert [e.token for e in asked.logprobs] == list(asked.token_ids) and all(e.top == () for e in asked.logprobs)


def test_a_batch_with_one_row_asking_equals_each_alone(dense_engine, tokenizer):
    requests = [GenerationRequest(_prompt(tokenizer, t), SamplingParams(max_tokens=30, logprobs=n), use_mtp=True)
                for t, n in (("List the tests.", 2), ("Explain what a hash map is.", None))]
    alone = [dense_engine.submit(r).result() for r in requests]
    together = [s.result() for s in [dense_engine.submit(r) for r in requests]]
    assert [f.token_ids for f in together] == [f.token_ids for f in alone]
    assert [e.token for e in together[0].logprobs] == list(together[0].token_ids) and not together[1].logprobs
    for a, b in zip(together[0].logprobs, alone[0].logprobs):  # a batch's rows round apart from a row's alone
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top] and abs(a.logprob - b.logprob) < 2e-3


def test_the_events_carry_them_through_json(dense_engine, tokenizer):
    fin = dense_engine.submit(GenerationRequest(_prompt(tokenizer), SamplingParams(max_tokens=4, logprobs=1))).result()
    again = event_from_dict(event_dict(fin))
    assert isinstance(again, Finished) and again.logprobs == fin.logprobs


@pytest.fixture(scope="module")
def url(tiny_dense_url):
    return tiny_dense_url


def test_openai_chat_logprobs_streamed_and_not(url):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="tiny-dense", messages=[{"role": "user", "content": "Explain what src/app.py does"}], max_tokens=30,
               temperature=0, logprobs=True, top_logprobs=2, extra_body={"enable_thinking": False})
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    streamed = [c for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices
                for c in ((chunk.choices[0].logprobs and chunk.choices[0].logprobs.content) or [])]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_in_the_legacy_shape(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 5, "temperature": 0, "logprobs": 2},
                   timeout=60).json()["choices"][0]
    lp = r["logprobs"]
    assert "".join(lp["tokens"]) == r["text"] and len(lp["token_logprobs"]) == 5
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


@pytest.mark.parametrize("body", [{"logprobs": False, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                                  {"logprobs": "yes"}])
def test_bad_logprobs_requests_are_400s(url, body):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body}, timeout=60)
    assert r.status_code == 400, r.text


def test_responses_log_probabilities_streamed_and_not(url):
    """Responses (`include: ["message.output_text.logprobs"]` and/or `top_logprobs`): the output
    text part holds its tokens' entries, each text delta those of its own text, and the done event
    all of them, with the OpenAI SDK's strict validation; asked for nothing, every list is empty.
    They equal chat's for the same turn."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    ask = dict(model="tiny-dense", input="Explain what src/app.py does", max_output_tokens=30, temperature=0,
               reasoning={"effort": "none"})
    whole = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    (part,) = [c for item in whole.output if item.type == "message" for c in item.content]
    assert "".join(lp.token for lp in part.logprobs) == part.text and part.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in part.logprobs)
    chat = client.chat.completions.create(model="tiny-dense", messages=[{"role": "user", "content": ask["input"]}],
                                          max_tokens=30, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"enable_thinking": False})
    assert [(c.token, c.logprob) for c in chat.choices[0].logprobs.content] == [(lp.token, lp.logprob) for lp in part.logprobs]
    deltas, done = [], None
    with client.responses.stream(**ask, top_logprobs=2) as stream:  # top_logprobs alone asks too
        for event in stream:
            if event.type == "response.output_text.delta":
                assert "".join(lp.token for lp in event.logprobs) == event.delta
                deltas += event.logprobs
            elif event.type == "response.output_text.done":
                done = event
    assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in part.logprobs]
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [(lp.token, lp.logprob) for lp in part.logprobs]
    plain = client.responses.create(**ask)
    assert all(not c.logprobs for item in plain.output if item.type == "message" for c in item.content)
    with client.responses.stream(**ask) as stream:
        assert all(e.logprobs == [] for e in stream if e.type in ("response.output_text.delta", "response.output_text.done"))


@pytest.mark.parametrize("extra", [{"top_logprobs": 21}, {"top_logprobs": "3"}, {"include": "message.output_text.logprobs"}])
def test_bad_responses_log_probabilities_are_400s(url, extra):
    r = httpx.post(url + "/v1/responses", json={"input": "x", "max_output_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400, r.text
