"""The draft vocabulary: pure bookkeeping, then the engine drafting over a narrowed set, where
outputs must stay exactly the model's (greedy) or distributed as the model's (sampled)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.draft_vocab import ROUND_TO, DraftVocab
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import Sampler, SamplingParams, probabilities
from mtplx.engine.speculation import accept_drafts
from test_mtp_held_out import sampled_mtp_vs_ar
from test_scheduler import assert_mixed_batch_equals_alone, batch_sizes  # noqa: F401  (batch_sizes: a fixture)


def _prompt(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True))


# -- bookkeeping ---------------------------------------------------------------------------
def test_no_set_before_warmup_then_the_seen_tokens_rounded_up():
    vocab = DraftVocab(4096, always=[4000], warmup=100, window=50)
    assert not vocab.observe(list(range(10)) * 5) and vocab.ids() is None  # 50 seen < warmup
    assert vocab.observe(list(range(10)) * 10)  # the last 50 had nothing new
    ids = vocab.ids()
    assert len(ids) == ROUND_TO and ids == sorted(ids)
    assert set(range(10)) | {4000} <= set(ids)  # the seen ones and the end-of-turn id


def test_new_tokens_switch_it_off_and_back_on_with_a_gap():
    vocab = DraftVocab(4096, warmup=10, window=100, on_rate=0.03, off_rate=0.08)
    vocab.observe([1, 2, 3] * 40)
    assert vocab.ids() is not None
    vocab.observe(range(100, 105))  # 5 new of the last 100: under off_rate, stays on
    assert vocab.ids() is not None
    vocab.observe(range(200, 205))  # 10 of 100: off
    assert vocab.ids() is None
    vocab.observe([1] * 95)  # 5 of 100 again: above on_rate, stays off
    assert vocab.ids() is None
    vocab.observe([1] * 30)
    assert set(range(100, 105)) | set(range(200, 205)) <= set(vocab.ids())


def test_a_set_near_half_the_vocabulary_is_not_used():
    vocab = DraftVocab(1024, warmup=0, window=10)
    vocab.observe(range(600))
    vocab.observe([0] * 10)
    assert vocab.ids() is None  # 768 rows of 1024: too little saved


def test_a_few_new_tokens_wait_for_a_refresh():
    vocab = DraftVocab(65536, warmup=0, window=1000, on_rate=1.0, off_rate=1.0)
    vocab.observe(range(2000))
    first = vocab.ids()
    assert len(first) == 2048
    assert not vocab.observe([60000])  # one token outside: not worth a re-gather
    assert vocab.observe(range(60001, 60040))  # 40 > 2048 / 64
    assert 60000 in vocab.ids() and 60039 in vocab.ids()


def test_kept_across_restarts_and_a_damaged_file_is_discarded(tmp_path):
    path = tmp_path / "dv" / "model.json"
    vocab = DraftVocab(4096, path=path, warmup=10, window=20)
    vocab.observe([5, 6, 7] * 10)
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    again = DraftVocab(4096, path=path, warmup=10, window=20)
    assert again.ids() == vocab.ids() and again.seen == 30 and again.new_rate() == vocab.new_rate()
    for bad in ("{not json", json.dumps({"vocab_size": 4096, "counts": {"99999": 1}}),
                json.dumps({"vocab_size": 512, "counts": {}}), json.dumps([1, 2])):
        path.write_text(bad)
        fresh = DraftVocab(4096, path=path, warmup=10, window=20)
        assert fresh.seen == 0 and fresh.ids() is None


def test_an_unwritable_home_costs_only_persistence(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    vocab = DraftVocab(4096, path=blocked / "sub" / "v.json", warmup=1, window=5, on_rate=1.0, off_rate=1.0)
    assert vocab.observe([1, 2, 3, 1, 2, 3]) and vocab.ids() is not None


# -- exactness -------------------------------------------------------------------------------
def test_rejection_sampling_with_a_draft_that_cannot_reach_some_tokens():
    """q is zero outside the draft vocabulary; accepted drafts plus residual draws still give p."""
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler(params)
    target = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0] * 5])
    narrow = probabilities(mx.array([0.0, 2.0, 1.0]), params)  # over tokens 1, 3, 4 only
    q = mx.zeros((5,)).at[mx.array([1, 3, 4])].add(narrow)
    p = np.array(probabilities(target[0], params))
    trials, counts = 6000, np.zeros(5)
    for _ in range(trials):
        draft = [1, 3, 4][sampler.draw(narrow)]
        kept, extra = accept_drafts(target, [draft], [q], sampler)
        counts[draft if kept else extra] += 1
    assert np.abs(counts / trials - p).max() < 0.03


@pytest.fixture
def narrowed(engine):
    """The engine drafting over a set that leaves out tokens the model writes (every third id
    of the first 1536, all others out): acceptance drops, outputs must not change."""
    ids = [t for t in range(1536) if t % 3]

    def narrow():
        saved = engine.draft_vocab
        engine.draft_vocab = None  # no refresh from finished replies while the test runs
        assert engine.runner.use_draft_ids(ids)
        return saved

    saved = engine.call(narrow)
    yield engine
    engine.call(lambda: (setattr(engine, "draft_vocab", saved), engine.runner.use_draft_ids(saved and saved.ids())))


def test_draft_logits_are_the_full_logits_at_the_set(narrowed):
    def compare():
        runner = narrowed.runner
        h = mx.random.normal((1, 3, runner.embedding.weight.shape[1]), key=mx.random.key(0))
        full, part = runner.logits(h), runner.draft_logits(h)
        return np.array(full[..., runner.draft_ids]), np.array(part)

    full, part = narrowed.call(compare)
    assert part.shape[-1] == 1024 and np.allclose(full, part, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 3])
def test_narrowed_mtp_greedy_equals_ar_greedy(narrowed, depth):
    prompt = _prompt(narrowed, "Read src/cache/store.py and explain what it does.")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ar = narrowed.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
    mtp = narrowed.submit(GenerationRequest(prompt, params, use_mtp=True, depth=depth)).result()
    assert mtp.token_ids == ar.token_ids
    outside = [t for t in ar.token_ids if t >= 1536 or t % 3 == 0]
    assert outside, "the set must leave out tokens the reply uses, or the test proves nothing"
    assert mtp.stats.verify_calls > 0


def test_narrowed_mixed_batch_equals_alone(narrowed, tokenizer, batch_sizes):
    """Greedy rows of two depths, a seeded sampled row, a tool rule and a history-free mask share
    a batch: each row drafts over the set or the whole vocabulary exactly as it would alone, so
    each gets its own tokens."""
    prompts = [_prompt(narrowed, q) for q in ("List the files in src.", "What does parse_args do?",
                                               "Fix the failing test.", "Explain the cache.")]
    assert_mixed_batch_equals_alone(narrowed, tokenizer, prompts, batch_sizes)


def test_narrowed_sampled_mtp_matches_ar_distribution(dense_engine):
    """Sampling with drafts from a narrowed q: the second and third tokens over 300 seeds each
    agree with AR's within sampling noise (total variation)."""
    ids = [t for t in range(1536) if t % 3]
    saved = dense_engine.call(lambda: (dense_engine.draft_vocab, setattr(dense_engine, "draft_vocab", None),
                                       dense_engine.runner.use_draft_ids(ids))[0])
    try:
        support, tv = sampled_mtp_vs_ar(dense_engine, _prompt(dense_engine, "Write a short note about caching."), 300)
    finally:
        dense_engine.call(lambda: (setattr(dense_engine, "draft_vocab", saved),
                                   dense_engine.runner.use_draft_ids(saved and saved.ids())))
    assert support > 3
    assert tv < 0.25, tv


# -- the engine learns it ------------------------------------------------------------------
def test_prompt_tokens_pad_the_set_before_low_ids():
    vocab = DraftVocab(4096, warmup=0, window=100)
    vocab.observe_prompt([3000, 3000, 3001] + [10] * 5)
    vocab.observe([1, 2] * 60)
    ids = vocab.ids()
    assert len(ids) == ROUND_TO and {1, 2, 3000, 3001, 10} <= set(ids)
    assert vocab.seen == 120  # prompt tokens are never counted as generated


def test_auto_uses_a_set_only_where_the_lm_head_dominates(monkeypatch):
    """The embedded models' LM head is about half a draft step: auto leaves them on the whole
    vocabulary; `on` forces a set (tests), `off` never learns one."""
    from mtplx.catalog import resolve
    from mtplx.engine.engine import DRAFT_VOCAB_SHARE, Engine, EngineConfig

    for mode, expect in (("auto", False), ("on", True), ("off", False)):
        monkeypatch.setenv("MTPLX_DRAFT_VOCAB", mode)
        engine = Engine(resolve("tiny-dense"), EngineConfig()).start()
        try:
            share = engine.call(engine.runner.lm_head_share)
            assert 0.4 < share < DRAFT_VOCAB_SHARE  # 4096 x 256 against a 256-wide layer and its fc
            assert (engine.draft_vocab is not None) == expect and ("draft_vocab" in engine.health()) == expect
        finally:
            engine.stop()


def test_the_engine_learns_a_set_keeps_it_and_reports_it(mtplx_home, monkeypatch):
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig

    monkeypatch.setenv("MTPLX_DRAFT_VOCAB", "on")
    engine = Engine(resolve("tiny-dense"), EngineConfig()).start()
    try:
        vocab = engine.draft_vocab
        assert engine.health()["draft_vocab"]["tokens"] is None
        engine.call(lambda: engine.draft_vocab.observe([7, 8, 9] * 400))
        engine.call(lambda: engine.runner.use_draft_ids(vocab.ids()))  # what _finish does after a change
        prompt = _prompt(engine, "Explain the cache.")
        fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=24), use_mtp=True, depth=2)).result()
        health = engine.health()["draft_vocab"]
        assert health["of"] == 4096 and health["generated_seen"] == 1200 + len(fin.token_ids)
        assert set(prompt) & set(vocab.context)  # the prompt was counted apart
    finally:
        engine.stop()
    files = list((mtplx_home / "draft-vocab").glob("*.json"))
    assert len(files) == 1
    again = Engine(resolve("tiny-dense"), EngineConfig()).start()
    try:
        assert again.draft_vocab.seen >= 1200 and again.runner.draft_ids is not None
        assert again.health()["draft_vocab"]["tokens"] == len(again.draft_vocab.ids())
    finally:
        again.stop()


def test_a_turn_without_tools_drafts_over_the_set(narrowed, tokenizer):
    """A history-free rule ("never": every turn without tools) drafts over the draft vocabulary
    with the rule taken there (logit_mask.py), as a turn with tools does: the LM head's whole
    vocabulary is computed for the verify only. The tokens are AR's under the rule."""
    from mtplx.engine.tool_rule import ToolRule

    prompt = _prompt(narrowed, "Read src/cache/store.py and explain what it does.")
    rule = ToolRule("never", tokenizer.convert_tokens_to_ids("<tool_call>"))
    request = lambda mtp: GenerationRequest(prompt, SamplingParams(max_tokens=48, ignore_eos=True), use_mtp=mtp,
                                            depth=3, tool_rule=rule)
    ar = narrowed.submit(request(False)).result()
    runner, calls = narrowed.runner, []
    whole = runner.logits
    runner.logits = lambda hidden: (calls.append(hidden.shape[1]), whole(hidden))[1]
    try:
        mtp = narrowed.submit(request(True)).result()
    finally:
        del runner.logits
    assert mtp.token_ids == ar.token_ids and rule.call_open not in ar.token_ids
    assert mtp.stats.verify_calls > 0
    # whole-vocabulary logits: the plain steps before the first round, then the verifies (k + 1
    # positions each, fewer as max_tokens nears) and never a draft step (one position)
    first = next(i for i, n in enumerate(calls) if n > 1)
    assert all(n > 1 for n in calls[first:]) and len(calls) - first == mtp.stats.verify_calls
