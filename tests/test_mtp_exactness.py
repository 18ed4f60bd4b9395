"""Engine invariants on the real tiny models: MTP changes speed, never output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx import fast_path
from mtplx.chat import render
from mtplx.engine import cache_state
from mtplx.state import snapshot
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import Sampler, SamplingParams, probabilities
from mtplx.engine.speculation import accept_drafts
from mtplx.events import PrefillProgress
from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus


@pytest.fixture(scope="module")
def agent_prompt(tokenizer):
    convo = conversation(42, Corpus(), Sizes(10, 30), max_user_turns=1)
    messages = convo["messages"][:4]  # system, user, assistant tool call, tool result
    return tuple(render(tokenizer, messages, convo["tools"]))


def _run(engine, prompt, **kw):
    sampling = SamplingParams(max_tokens=kw.pop("max_tokens", 48), **kw.pop("sampling", {}))
    return engine.submit(GenerationRequest(prompt, sampling, **kw)).result()


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_mtp_greedy_equals_ar_greedy(engine, agent_prompt, depth):
    ar = _run(engine, agent_prompt, use_mtp=False)
    mtp = _run(engine, agent_prompt, use_mtp=True, depth=depth)
    assert mtp.token_ids == ar.token_ids and mtp.text == ar.text
    assert mtp.stats.mode == "mtp" and mtp.stats.verify_calls > 0


def test_chunk_size_does_not_change_output(engine, agent_prompt):
    from mtplx.engine.generation import Generation, StartPoint, events

    outs = []
    for chunk in (16, 100):
        gen = Generation(engine.runner, GenerationRequest(agent_prompt, SamplingParams(max_tokens=16)), use_mtp=False,
                         depth=1, chunk_size=chunk, eos_ids=engine.eos_ids, submitted_at=0.0)
        done = None
        finished = engine.call(lambda: list(events(gen, StartPoint(), lambda: False)))[-1]
        outs.append(finished.token_ids)
    assert outs[0] == outs[1]


def _fed_cache(runner, tokens):
    cache = runner.new_trunk_cache()
    for start in range(0, len(tokens), 32):
        runner.hidden(tokens[start : start + 32], cache)
    return cache


def assert_same_values(x: np.ndarray, y: np.ndarray) -> None:
    """Bit-identical on a path whose matmul rows do not depend on the call's row count; on MKL
    (fast_path.rows_bitwise) equal to fp32 rounding: 1e-5 of the tensor's scale, where rounding
    gives ~2e-7 and a wrong kept token ~0.5. tests/test_fast_path.py reruns these tests on the
    reference path, bitwise."""
    if fast_path.rows_bitwise(fast_path.activate()):
        assert np.array_equal(x, y)
    else:
        assert x.shape == y.shape and np.abs(x - y).max() <= 1e-5 * max(1.0, float(np.abs(y).max()))


def _assert_same_state(a, b):
    sa, sb = snapshot.snapshot(a), snapshot.snapshot(b)
    for la, lb in zip(sa, sb):
        assert la.kind == lb.kind and la.offset == lb.offset
        for x, y in zip(la.arrays, lb.arrays):
            assert_same_values(np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32)))


@pytest.mark.parametrize("capture", [True, False])
def test_rollback_equals_feeding_only_kept_tokens(engine, agent_prompt, capture):
    """After a verify over 5 tokens keeping 2, the cache is exactly a feed of those 2."""
    def work():
        runner = engine.runner
        prompt = list(agent_prompt[:90])
        extra = list(agent_prompt[90:95])
        cache = _fed_cache(runner, prompt)
        if capture and runner.can_capture:
            cache_state.set_capture(cache, True)
            runner.hidden(extra, cache)
            cache_state.keep_verified(cache, len(extra), 2)
        else:
            saved = cache_state.recurrent_copy(cache)
            runner.hidden(extra, cache)
            cache_state.rewind(cache, saved, len(extra))
            runner.hidden(extra[:2], cache)
        cold = _fed_cache(runner, prompt)
        runner.hidden(extra[:2], cold)
        _assert_same_state(cache, cold)

    engine.call(work)


def test_rejection_sampling_reproduces_the_target_distribution():
    """Drafts from q, accepted by the rule, give tokens distributed exactly as p."""
    params = SamplingParams(temperature=1.0, seed=11)
    sampler = Sampler(params)
    target = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q = probabilities(mx.array([0.0, 2.0, 0.0, 1.0, -1.0]), params)  # a deliberately poor draft
    p = np.array(probabilities(target[0], params))
    trials, counts = 6000, np.zeros(5)
    for _ in range(trials):
        draft = sampler.draw(q)
        kept, extra = accept_drafts(target, [draft], [q], sampler)
        counts[draft if kept else extra] += 1
    assert np.abs(counts / trials - p).max() < 0.03


def test_a_first_token_that_shows_nothing_leads_with_plain_steps(engine, tokenizer):
    """A reply that opens with markup the client is not shown (here a tool call, held back until
    complete) takes a few plain steps before the MTP head's prompt KV is computed, so the first
    delta never waits for it; the output is still exactly AR greedy's."""
    from mtplx.engine.generation import HIDDEN_LEAD
    from mtplx.events import DraftVerified, Tokens

    convo = conversation(42, Corpus(), Sizes(10, 30), max_user_turns=1)
    prompt = tuple(render(tokenizer, convo["messages"][:2], convo["tools"]))
    ar = _run(engine, prompt, use_mtp=False, max_tokens=24)
    sub = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=24), use_mtp=True, depth=2))
    events = list(sub)
    assert events[-1].token_ids == ar.token_ids
    before_drafts = []
    for event in events:
        if isinstance(event, DraftVerified):
            break
        if isinstance(event, Tokens):
            before_drafts.extend(event.token_ids)
    first = next(e for e in events if isinstance(e, Tokens))
    assert first.token_ids == ar.token_ids[:1] and not first.pieces  # it showed the client nothing
    chunks = sum(isinstance(e, PrefillProgress) for e in events)
    # the first token, the plain steps, then (a prompt of several chunks) the head's catch-up steps
    assert HIDDEN_LEAD + 1 <= len(before_drafts) <= HIDDEN_LEAD + 1 + chunks - 1
    assert events[-1].stats.verify_calls > 0 and events[-1].stats.mtp_prefill_s > 0


def test_a_long_prompts_head_kv_catches_up_between_plain_steps(engine, tokenizer):
    """After a prompt of several prefill chunks, the MTP head's prompt KV is computed a chunk at a
    time with a plain step between (the stream never stops for all of it), then drafting starts;
    the output is still exactly AR greedy's."""
    from mtplx.events import DraftVerified, Tokens

    from mtplx.engine.generation import HIDDEN_LEAD

    text = " ".join(f"step {i}: read the file, run the tests, write down what failed." for i in range(120))
    prompt = tuple(render(tokenizer, [{"role": "user", "content": text}], None))
    ar = _run(engine, prompt, use_mtp=False, max_tokens=40)
    events = list(engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=40), use_mtp=True, depth=2)))
    assert events[-1].token_ids == ar.token_ids
    chunks = sum(isinstance(e, PrefillProgress) for e in events)
    assert chunks > 2
    before_drafts = []  # (token, whether its event showed the client anything)
    for event in events:
        if isinstance(event, DraftVerified):
            break
        if isinstance(event, Tokens):
            before_drafts += [(token, bool(event.pieces)) for token in event.token_ids]
    shown_at = next((i for i, (_, shown) in enumerate(before_drafts) if shown), len(before_drafts))
    lead = min(HIDDEN_LEAD, shown_at)  # a first token that shows nothing leads with plain steps
    # then at least one plain step while the head's KV catches up, at most one per chunk past the first
    assert 1 + lead + 1 <= len(before_drafts) <= 1 + lead + chunks - 1
    assert events[-1].stats.verify_calls > 0 and events[-1].stats.mtp_prefill_s > 0
