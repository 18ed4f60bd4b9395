"""Predicted outputs (OpenAI's `prediction`): the prediction drafts where the reply follows it, and
the reply is exactly what it is without one (greedy, both models), whatever the prediction."""

from __future__ import annotations

import httpx
import pytest

from mtplx.engine.prediction import DEPTH, Prediction
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams


def test_the_reply_is_followed_along_the_prediction_and_rejoins_it_after_an_edit():
    p = Prediction(range(100, 140))
    assert p.drafts([], 4) == [100, 101, 102, 103]
    assert p.drafts([100, 101], 3) == [102, 103, 104]  # following it
    assert p.drafts([100, 101, 102, 7, 8], 4) == []  # an edit: off the prediction
    assert p.drafts([100, 101, 102, 7, 8, 106, 107, 108], 2) == [109, 110]  # rejoined past the edit
    assert len(p.drafts([100, 101, 102, 7, 8, 106, 107, 108], 99)) == DEPTH
    twice = Prediction((1, 2, 3, 9, 1, 2, 3, 8))
    assert twice._rejoin([1, 2, 3], after=4) == 7 and twice._rejoin([1, 2, 3], after=8) == 3  # ahead, else first
    assert twice._rejoin([5, 1, 2], after=0) is None and twice._rejoin([1], after=0) is None


def _long_reply(engine, tokenizer, prediction=(), mtp=True, **sampling):
    prompt = tuple(tokenizer.encode("import codecs\n\n### Codec APIs\n\nclass Codec(codecs.Codec):\n"))
    params = SamplingParams(max_tokens=200, ignore_eos=True, **sampling)  # long enough to follow a prediction
    return engine.submit(GenerationRequest(prompt, params, use_mtp=mtp, depth=3, prediction=tuple(prediction))).result()


def test_the_reply_is_the_same_whatever_the_prediction(engine, tokenizer):
    ar = _long_reply(engine, tokenizer, mtp=False)
    mtp = _long_reply(engine, tokenizer)
    ids = list(ar.token_ids)
    edited = ids[:80] + tokenizer.encode(" # an edit\n", add_special_tokens=False) + ids[86:]
    for prediction in (ids, edited, ids[::-1], [5] * 300):
        run = _long_reply(engine, tokenizer, prediction)
        assert run.token_ids == ar.token_ids
        assert run.stats.predicted_accepted <= run.stats.predicted_drafted
    exact, rejoined = _long_reply(engine, tokenizer, ids), _long_reply(engine, tokenizer, edited)
    # Following the prediction, a verify takes up to 16 tokens: far fewer forwards than MTP alone.
    assert exact.stats.predicted_accepted >= 0.9 * len(ids) and exact.stats.verify_calls * 3 < mtp.stats.verify_calls
    assert rejoined.stats.predicted_accepted > 150  # drafting resumed after the edit


def test_without_mtp_a_prediction_still_drafts_between_ar_steps(engine, tokenizer):
    """A model without an MTP head (or --no-mtp): AR steps off the prediction, predicted verifies
    on it; the reply is AR's."""
    ar = _long_reply(engine, tokenizer, mtp=False)
    ids = list(ar.token_ids)
    edited = ids[:80] + tokenizer.encode(" # an edit\n", add_special_tokens=False) + ids[86:]
    for prediction in (ids, edited, ids[::-1]):
        run = _long_reply(engine, tokenizer, prediction, mtp=False)
        assert run.token_ids == ar.token_ids and run.stats.mode == "ar"
    followed = _long_reply(engine, tokenizer, edited, mtp=False)
    assert followed.stats.predicted_accepted > 150 and followed.stats.verify_calls < 40


def test_a_sampled_reply_with_a_prediction_keeps_its_length_and_seed(engine, tokenizer):
    ids = _long_reply(engine, tokenizer, mtp=False).token_ids
    runs = [_long_reply(engine, tokenizer, ids, temperature=0.7, seed=5) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 200


@pytest.fixture(scope="module")
def url(tiny_dense_url):
    return tiny_dense_url


def test_chat_takes_a_prediction_and_reports_its_tokens(url):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    ask = dict(model="m", messages=[{"role": "user", "content": "Show me core/billing/cp855.py"}], max_tokens=120,
               temperature=0, extra_body={"ignore_eos": True, "enable_thinking": False})
    free = client.chat.completions.create(**ask)
    text = free.choices[0].message.content
    predicted = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 60 and details.rejected_prediction_tokens >= 0
    assert free.usage.completion_tokens_details.accepted_prediction_tokens is None  # none given, none reported
    parts = client.chat.completions.create(**ask, prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert parts.choices[0].message.content == text
    with pytest.raises(BadRequestError, match="prediction"):
        client.chat.completions.create(**ask, prediction={"type": "diff", "content": text})


def test_the_mtp_head_sees_every_pair_a_predicted_run_skipped(engine, tokenizer):
    """Predicted rounds do not run the MTP head; their (hidden, token) pairs are fed to it later
    (at its next draft, or in catch-up feeds on a long run). After a reply that followed a
    prediction for 150 tokens and MTP after it, the head's cache covers the same pairs with the
    same keys as after a reply drafted by MTP throughout."""
    import numpy as np

    from mtplx.engine.generation import Generation
    from mtplx.state.turn import StartPoint

    prompt = tuple(tokenizer.encode("import codecs\n\n### Codec APIs\n\nclass Codec(codecs.Codec):\n"))
    reply = _long_reply(engine, tokenizer, mtp=False).token_ids

    def decoded(prediction):
        request = GenerationRequest(prompt, SamplingParams(max_tokens=200, ignore_eos=True), prediction=prediction)
        gen = Generation(engine.runner, request, use_mtp=True, depth=3, chunk_size=64, eos_ids=engine.eos_ids,
                         submitted_at=0.0)
        for _ in gen.prefill(StartPoint(), (), None):
            pass
        list(gen.first_token())
        while gen.finish_reason is None:
            list(gen.step())
        head = gen.state.mtp
        return gen.state.length - len(gen.speculator.pending_tokens), head.offset, np.array(head.keys[..., :head.offset, :])

    plain, followed = engine.call(lambda: decoded(())), engine.call(lambda: decoded(tuple(reply[:150])))
    assert plain[0] == plain[1] and followed[0] == followed[1]  # every pair but the pending ones is in the head
    n = min(plain[1], followed[1])
    assert np.allclose(plain[2][..., :n, :], followed[2][..., :n, :], atol=1e-4)
