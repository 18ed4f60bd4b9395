"""Compiled short steps (engine/compiled.py) give the modules' forward bit for bit: hidden states,
logits, KV and recurrent caches, the states a capturing verify records, and the MTP head. The
attention layers are mlx-lm's; a GatedDeltaNet layer is gdn_capture's (gdn_step's recurrence,
mlx-lm's to float32 rounding)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mtplx.engine import cache_state, compiled


def _pair(runner, prompt):
    caches = []
    for _ in range(2):
        cache = runner.new_trunk_cache()
        hidden = runner.hidden(prompt, cache)  # longer than STEP_TOKENS: mlx-lm's own forward
        head = KVCache()
        runner.draft_hidden(hidden[:, :-1], prompt[1:], head)
        caches.append((cache, head))
    return caches


def _state_arrays(cache: list) -> list:
    return [a for layer in cache for a in layer.state if isinstance(a, mx.array)]


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("capture", [False, True])
def test_compiled_steps_equal_mlx_lm_forward(engine, capture):
    def work():
        runner = engine.runner
        assert runner._steps is not None and runner._head_steps is not None  # both models are known families
        prompt = list(range(10, 130))
        (plain, plain_head), (fast, fast_head) = _pair(runner, prompt)
        steps, head_steps = runner._steps, runner._head_steps
        for n in (1, 4, 2, compiled.STEP_TOKENS):
            tokens = list(range(200 + n, 200 + 2 * n))
            cache_state.set_capture(plain, capture)
            cache_state.set_capture(fast, capture)
            runner._steps, runner._head_steps = None, None
            try:
                a = runner.hidden(tokens, plain)
                da = runner.draft_hidden(a, tokens, plain_head)
            finally:
                runner._steps, runner._head_steps = steps, head_steps
            b = runner.hidden(mx.array(tokens), fast)  # a lazy token array, as the draft chain feeds it
            db = runner.draft_hidden(b, tokens, fast_head)
            assert _same(a, b) and _same(runner.logits(a), runner.logits(b)) and _same(da, db)
            assert all(_same(x, y) for x, y in zip(_state_arrays(plain), _state_arrays(fast)))
            assert all(_same(x, y) for x, y in zip(_state_arrays([plain_head]), _state_arrays([fast_head])))
            if capture and runner.has_recurrent:
                for la, lb in zip(plain, fast):
                    if getattr(la, "positions", None) is not None:
                        assert len(la.positions) == len(lb.positions) == n
                        assert all(_same(x, y) for pa, pb in zip(la.positions, lb.positions) for x, y in zip(pa, pb))
            cache_state.set_capture(plain, False)
            cache_state.set_capture(fast, False)

    engine.call(work)


def test_each_layer_step_is_handed_to_the_device_as_it_is_built(dense_engine, monkeypatch):
    """A decode step starts every layer's compute before the next layer is built (one async_eval
    per trunk layer, one per head step), bit-identical to building the step whole; a sharded
    rank's head never evaluates early."""
    handed = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (handed.append(arrays[0].shape), real(*arrays)))

    def step(pipeline: bool):
        monkeypatch.setattr(compiled, "PIPELINE", pipeline)
        runner = dense_engine.runner
        cache, head = _pair(runner, list(range(10, 40)))[0]
        handed.clear()
        hidden = runner.hidden(mx.array([5, 6]), cache)
        drafted = runner.draft_hidden(hidden, [7, 8], head)
        mx.eval(hidden, drafted)
        return len(handed), hidden, drafted, _state_arrays(cache)

    calls_on, *on = dense_engine.call(lambda: step(True))
    calls_off, *off = dense_engine.call(lambda: step(False))
    assert calls_on == len(dense_engine.runner._steps.steps) + 1 and calls_off == 0
    assert _same(on[0], off[0]) and _same(on[1], off[1]) and all(_same(x, y) for x, y in zip(on[2], off[2]))
    assert compiled.build_head(dense_engine.runner.mtp, pipeline=False).pipeline is False


def test_unknown_layers_keep_mlx_lm_forward():
    class Inner:
        embed_tokens = norm = None
        layers = [object()]

    assert compiled.build(Inner()) is None


def test_long_inputs_and_batches_are_not_steps(dense_engine):
    steps = dense_engine.runner._steps
    cache = dense_engine.runner.new_trunk_cache()
    assert steps.usable(mx.zeros((1, compiled.STEP_TOKENS), dtype=mx.int32), cache)
    assert not steps.usable(mx.zeros((1, compiled.STEP_TOKENS + 1), dtype=mx.int32), cache)
    assert not steps.usable(mx.zeros((2, 1), dtype=mx.int32), cache)


def test_blocked_prefill_recurrence_equals_the_step_function(hybrid_engine, monkeypatch):
    """A prefill chunk's GatedDeltaNet recurrence in compiled blocks (gdn_capture.BLOCK) gives
    the step function run one position at a time bit for bit (hidden states and both caches, for
    chunk lengths that are and are not multiples of the block), and mlx-lm's own forward to
    float32 rounding."""
    from mlx_lm.models.qwen3_5 import GatedDeltaNet

    from mtplx.engine import gdn_capture

    runner = hybrid_engine.runner
    layers = [layer.linear_attn for layer in runner.inner.layers if hasattr(layer, "linear_attn")]
    assert layers and all(isinstance(n, gdn_capture.CapturingGatedDeltaNet) for n in layers)
    chunked = layers[0].chunked

    def prefill(cls, block):
        monkeypatch.setattr(gdn_capture, "BLOCK", block)
        for n in layers:
            n.__class__, n.chunked = cls, False  # the blocked path (test_gdn_prefill: the chunked one)
        cache = runner.new_trunk_cache()
        hidden = [runner.hidden(list(range(10 + s, 10 + s + length)), cache)
                  for s, length in ((0, 256), (256, 37), (293, 16))]
        mx.eval(hidden, _state_arrays(cache))
        return hidden, _state_arrays(cache)

    def work():
        blocked = prefill(gdn_capture.CapturingGatedDeltaNet, gdn_capture.BLOCK)
        stepwise = prefill(gdn_capture.CapturingGatedDeltaNet, 10**6)  # one uncompiled position at a time
        theirs = prefill(GatedDeltaNet, gdn_capture.BLOCK)
        return blocked, stepwise, theirs

    try:
        (ha, ca), (hb, cb), (hc, cc) = hybrid_engine.call(work)
    finally:
        gdn_capture.install(hybrid_engine.runner.model, chunked)
    assert all(_same(a, b) for a, b in zip(ha, hb)) and all(_same(a, b) for a, b in zip(ca, cb))
    for a, c in zip(ha + ca, hc + cc):
        scale = max(1.0, mx.abs(c).max().item())
        assert a.shape == c.shape and mx.abs(a.astype(mx.float32) - c.astype(mx.float32)).max().item() <= 1e-4 * scale


def test_head_step_over_pending_pairs_returns_only_the_last_and_stores_every_pair(engine):
    """A draft chain starts from the last pending pair's head output; the others are only stored.
    With `last` the head's cache ends the same as a full step's, and the returned row equals the
    full step's last row (alone, and per row of a right-padded batch)."""
    from mtplx.engine.batch_cache import RaggedKVCache

    def work():
        runner = engine.runner
        steps = runner._head_steps
        try:
            check(runner)
            runner._head_steps = None  # mlx-lm's module forward, as for families without compiled steps
            check(runner)
        finally:
            runner._head_steps = steps

    def check(runner):
        prompt = list(range(10, 130))
        (_, full_head), (_, last_head) = _pair(runner, prompt)
        hidden = mx.random.normal((1, 5, runner.mtp.fc.weight.shape[0]), key=mx.random.key(3))
        tokens = [301, 302, 303, 304, 305]
        full = runner.draft_hidden(hidden, tokens, full_head)
        last = runner.draft_hidden(hidden, tokens, last_head, last=True)
        assert last.shape == (1, 1, full.shape[-1])
        assert mx.allclose(last, full[:, -1:], atol=1e-5).item()
        assert all(_same(x, y) for x, y in zip(_state_arrays([full_head]), _state_arrays([last_head])))

        # Two rows, right-padded to 5 pairs: row 0 has 5, row 1 has 2 (its last at index 1).
        rows = [_pair(runner, prompt)[0][1], _pair(runner, prompt[:-7])[0][1]]
        batch = RaggedKVCache.from_rows(rows)
        both = mx.concatenate([hidden, hidden[:, ::-1]])
        ids = mx.array([tokens, tokens[::-1]])
        got = runner.draft_hidden(both, ids, batch, last=mx.array([4, 1]))
        assert got.shape == (2, 1, full.shape[-1])
        for b, (row, n) in enumerate(zip(rows, (5, 2))):
            alone = runner.draft_hidden(both[b : b + 1, :n], ids[b, :n].tolist(), row)
            assert mx.allclose(got[b], alone[0, -1:], atol=1e-5).item()

    engine.call(work)
