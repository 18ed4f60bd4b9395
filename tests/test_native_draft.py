"""The MTP head's greedy draft chain in one C call (mtplx/engine/native_draft.py): it drafts what
the MLX chain drafts, its pending pairs' keys and values are the MLX head step's, a rule's vector
bans what it bans, and MTP with it still equals AR greedy token for token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.logit_bias import LogitBias
from mtplx.engine.logit_mask import LogitMask
from mtplx.engine import native_draft
from mtplx.engine.native_draft import BUILD, NativeDraft
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams

# Where the kernel cannot be built (no C compiler, no AVX2/FMA/F16C, not Linux x86_64) the MLX
# chain drafts, which every other MTP test covers.
pytestmark = pytest.mark.skipif(BUILD.unavailable() is not None, reason=str(BUILD.unavailable()))

TEXT = ("Explain how a hash map handles collisions, with a short example in Python, and compare open "
        "addressing with separate chaining. ") * 3
STEPS, PAIRS = 4, 3


def _prompt(engine, text=TEXT):
    tok = engine.checkpoint.tokenizer
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def _native(engine) -> NativeDraft:
    native = engine.call(lambda: engine.runner.native_draft())
    assert native is not None, engine.runner.native_draft_reason  # the CPU fp32 path of this machine
    return native


def _chains(engine, mask: LogitMask | None = None) -> list[tuple[list[int], list[int], float]]:
    """At many points of a prompt: (MLX chain's drafts, C chain's drafts, largest difference of the
    pending pairs' keys and values), both chains over the same head cache and pending pairs."""
    runner, native = engine.runner, _native(engine)
    prompt = _prompt(engine)

    def work():
        hidden = runner.hidden(prompt, runner.new_trunk_cache())
        mx.eval(hidden)
        out = []
        for start in range(8, len(prompt) - PAIRS - 1, 5):
            caches = [runner.new_mtp_cache() for _ in range(2)]
            for cache in caches:
                runner.extend_head(hidden[:, :start], prompt[1:start + 1], cache)
            pending, tokens = hidden[:, start:start + PAIRS], prompt[start + 1:start + PAIRS + 1]
            with runner.small_forwards():
                m = runner.draft_hidden(pending, tokens, caches[0], last=True)
                want = []
                for i in range(STEPS):
                    logits = runner.draft_logits(m)[0, -1:]
                    logits = logits if mask is None else mask.on_drafts(logits, runner)
                    want.append(runner.draft_token(mx.argmax(logits, axis=-1)))
                    if i < STEPS - 1:
                        m = runner.draft_hidden(m, want[-1], caches[0])
                want = mx.concatenate(want).tolist()
            bias = None if mask is None else mask.draft_vector(runner)
            got = native.chain(pending, tokens, caches[1], STEPS, bias)
            assert caches[1].offset == start  # the chain leaves the head's cache as it found it
            keys, values = native.pending_kv(PAIRS)
            ref_keys = caches[0].keys[..., start:start + PAIRS, :]
            ref_values = caches[0].values[..., start:start + PAIRS, :]
            diff = max(float(mx.max(mx.abs(keys - ref_keys))), float(mx.max(mx.abs(values - ref_values))))
            out.append((want, got, diff))
        return out

    return engine.call(work)


def test_the_c_chain_drafts_what_the_mlx_chain_drafts(engine):
    rows = _chains(engine)
    drafts = [(w, g) for w, g, _ in rows]
    agree = sum(a == b for w, g in drafts for a, b in zip(w, g))
    # The C chain reads the head's matrices in half precision: a near-tie may fall the other way
    # (it costs acceptance, never exactness); everything else is the same chain.
    assert agree >= 0.95 * STEPS * len(drafts), drafts
    assert max(d for _, _, d in rows) < 2e-2  # the pending pairs' keys and values the cache takes


def test_a_rules_vector_bans_in_the_c_chain_what_it_bans_in_the_mlx_chain(engine):
    first = {w[0] for w, _, _ in _chains(engine)}
    mask = LogitMask(LogitBias(tuple((t, -100.0) for t in sorted(first))))  # every first draft seen, pushed down
    rows = _chains(engine, mask)
    assert all(g[0] not in first for _, g, _ in rows)
    agree = sum(a == b for w, g, _ in rows for a, b in zip(w, g))
    assert agree >= 0.95 * STEPS * len(rows)


def test_rows_stepping_together_draft_what_each_drafts_alone(engine, monkeypatch):
    """A batch's rows go through the kernel together (each product reads the head's matrices once
    for all of them): rows with different caches, pending pair counts and rule vectors draft, and
    leave pending keys and values, bit for bit what each row does in a call of its own, and with
    each product's rows of W shared between two threads or all on one."""
    monkeypatch.setattr(native_draft, "second_core", lambda: True)  # the kernel's helper, whatever this process lends
    monkeypatch.setattr(native_draft, "TEAM", True)
    runner, native = engine.runner, _native(engine)
    prompt = _prompt(engine)
    first = {w[0] for w, _, _ in _chains(engine)}
    bias = LogitMask(LogitBias(tuple((t, -100.0) for t in sorted(first)))).draft_vector(runner)

    def work():
        hidden = runner.hidden(prompt, runner.new_trunk_cache())
        mx.eval(hidden)
        rows = []
        for b, (start, pairs) in enumerate([(12, 3), (30, 1), (21, 4), (45, 2), (17, 3)]):
            cache = runner.new_mtp_cache()
            runner.extend_head(hidden[:, :start], prompt[1:start + 1], cache)
            mx.eval(cache.keys, cache.values)
            keys, values = np.array(cache.keys, copy=False), np.array(cache.values, copy=False)
            rows.append((hidden[:, start:start + pairs], prompt[start + 1:start + pairs + 1], keys, values, start,
                         bias if b == 3 else None))
        together = native.chain_rows(rows, STEPS)
        kv_together = [[np.array(a) for a in native.pending_kv(len(r[1]), b)] for b, r in enumerate(rows)]
        one_core = native.chain_rows(rows, STEPS, helper=False)  # no helper: every product on this thread
        kv_one_core = [[np.array(a) for a in native.pending_kv(len(r[1]), b)] for b, r in enumerate(rows)]
        alone, kv_alone = [], []
        for row in rows:
            alone.append(native.chain_rows([row], STEPS)[0])
            kv_alone.append([np.array(a) for a in native.pending_kv(len(row[1]))])
        return together, alone, kv_together, kv_alone, one_core, kv_one_core

    together, alone, kv_together, kv_alone, one_core, kv_one_core = engine.call(work)
    assert together == alone == one_core
    for (k1, v1), (k2, v2) in zip(kv_together, kv_one_core):  # the kernel's helper took part of each product
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
    assert together[3][0] not in first  # the row with a rule's vector drafted under it
    for (k1, v1), (k2, v2) in zip(kv_together, kv_alone):
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_mtp_with_the_c_chain_equals_ar_greedy_and_keeps_its_acceptance(engine, depth, monkeypatch):
    calls = []
    chain = NativeDraft.chain
    monkeypatch.setattr(NativeDraft, "chain", lambda self, *a: calls.append(1) or chain(self, *a))
    native = _native(engine)
    texts = ["Write a Python function that merges two sorted lists, and explain it.",
             "Why would a build fail after renaming a module?"]
    kept = {"c": 0, "mlx": 0}
    for text in texts:
        prompt = tuple(_prompt(engine, text))
        for bias in ((), ((5, -3.0), (17, 2.0))):  # with a logit bias the chain takes the rule's vector
            params = SamplingParams(max_tokens=48, logit_bias=bias)
            ar = engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
            for arm in kept:
                engine.call(lambda: setattr(engine.runner, "_native_draft", native if arm == "c" else None))
                try:
                    mtp = engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=depth)).result()
                finally:
                    engine.call(lambda: setattr(engine.runner, "_native_draft", native))
                assert mtp.token_ids == ar.token_ids
                kept[arm] += sum(mtp.stats.accepted_by_depth)
    assert len(calls) > 20  # the rounds drafted in C
    # The head's cache after C rounds (their pairs' keys and values) serves the chain as well as
    # the MLX chain's own: a wrong entry there would show as lost acceptance, not wrong tokens.
    assert kept["c"] >= 0.9 * kept["mlx"], kept


def test_switched_off_or_on_another_path_the_mlx_chain_drafts(dense_engine, monkeypatch):
    monkeypatch.setenv("MTPLX_NATIVE_DRAFT", "off")
    native, why = dense_engine.call(lambda: NativeDraft.for_runner(dense_engine.runner))
    assert native is None and why == "MTPLX_NATIVE_DRAFT=off"
    monkeypatch.delenv("MTPLX_NATIVE_DRAFT")
    native = _native(dense_engine)
    assert dense_engine.health()["draft_chain"] == "c kernel"
    cache = dense_engine.call(dense_engine.runner.new_mtp_cache)
    hidden = mx.zeros((1, 2, 256))
    assert native.chain(hidden, [1], cache, 2) is None  # pairs and hidden rows disagree: refused, not guessed
    assert native.chain(mx.zeros((1, 70, 256)), [1] * 70, cache, 2) is None  # past the kernel's 64 slots


def test_a_bigger_head_or_lm_head_keeps_the_mlx_chain(dense_engine, monkeypatch):
    """A head whose step is compute (more multiply-adds than the kernel pays for) is refused with
    the reason; LM-head rows too big to copy make a round draft with MLX, and MTP still equals AR."""
    from mtplx.engine import native_draft

    monkeypatch.setattr(native_draft, "MAX_HEAD_MACS", 100_000)
    native, why = dense_engine.call(lambda: NativeDraft.for_runner(dense_engine.runner))
    assert native is None and "compute-bound" in why
    monkeypatch.undo()
    native = _native(dense_engine)
    monkeypatch.setattr(native_draft, "MAX_LM_COPY_BYTES", 1024)
    dense_engine.call(lambda: setattr(native, "_lm_key", None))  # as if the draft vocabulary changed
    try:
        assert dense_engine.call(lambda: native.chain(mx.zeros((1, 1, 256)), [1], dense_engine.runner.new_mtp_cache(), 2)) is None
        prompt = tuple(_prompt(dense_engine, "Why would a build fail after renaming a module?"))
        params = SamplingParams(max_tokens=32)
        mtp = dense_engine.submit(GenerationRequest(prompt, params, use_mtp=True, depth=3)).result()
        ar = dense_engine.submit(GenerationRequest(prompt, params, use_mtp=False)).result()
        assert mtp.token_ids == ar.token_ids
    finally:
        monkeypatch.undo()
        dense_engine.call(lambda: setattr(native, "_lm_key", None))


def test_a_batch_drafts_every_row_in_c_and_each_row_equals_ar_greedy(engine, monkeypatch):
    """Four greedy requests arriving together decode as one batch; each round drafts all rows in
    C (two groups stepping together, on two threads), rows with different pending pairs and acceptance, one with a
    logit bias (its rule's vector), and every row's tokens equal that request's AR greedy run."""
    from test_scheduler import _submit_together

    batches = []
    chain_rows = NativeDraft.chain_rows
    monkeypatch.setattr(NativeDraft, "chain_rows", lambda self, rows, steps: batches.append(len(rows))
                        or chain_rows(self, rows, steps))
    _native(engine)
    texts = ["Write a Python function that merges two sorted lists.", "Why would a build fail after a rename?",
             "Describe how the cache module decides what to evict.", "What does load_config do?"]
    requests = [GenerationRequest(tuple(_prompt(engine, t)),
                                  SamplingParams(max_tokens=40, logit_bias=((9, -2.0),) if i == 3 else ()),
                                  use_mtp=True, depth=3) for i, t in enumerate(texts)]
    got = [s.result() for s in _submit_together(engine, requests)]
    assert max(batches) == 4  # rounds with all four rows drafted in C
    for request, mtp in zip(requests, got):
        ar = engine.submit(GenerationRequest(request.prompt, request.sampling, use_mtp=False)).result()
        assert mtp.token_ids == ar.token_ids
