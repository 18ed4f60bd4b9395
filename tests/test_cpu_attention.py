"""mtplx's CPU attention (mtplx/engine/cpu_attention.py) against MLX's kernel: the same values
(to fp32 rounding) for every mask kind and grouping the models use, and MLX's own kernel where a
call is small."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplx.engine import cpu_attention


def _inputs(heads, kv_heads, queries, keys, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((2, heads, queries, 64)), mx.random.normal((2, kv_heads, keys, 64)) * 2,
            mx.random.normal((2, kv_heads, keys, 64)))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("queries,keys", [(16, 1500), (5, 4000), (64, 64)])
def test_matches_mlx_for_every_mask(heads, kv_heads, queries, keys):
    q, k, v = _inputs(heads, kv_heads, queries, keys)
    keep = mx.arange(keys)[None, :] <= mx.arange(keys - queries, keys)[:, None]  # causal, as a boolean mask
    # a batch's left padding (row 1 starts 3 keys late): its first queries may see no key at all
    padded = mx.broadcast_to(keep, (2, 1, queries, keys)) & (mx.arange(keys) >= mx.array([0, 3]).reshape(2, 1, 1, 1))
    additive = mx.where(keep, 0.0, -1e9)
    per_head = mx.broadcast_to(keep, (2, heads, queries, keys))
    for mask in ("causal", None, keep, padded, additive, per_head):
        want = cpu_attention._mlx_attention(q, k, v, scale=0.125, mask=mask)
        got = cpu_attention.attention(q, k, v, scale=0.125, mask=mask)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=2e-6, rtol=1e-5, equal_nan=True).item(), (type(mask), mx.max(mx.abs(got - want)).item())


def test_the_exponent_is_accurate_over_the_softmax_range():
    scores = mx.concatenate([mx.linspace(-120, 0, 100_000), mx.array([-mx.inf, 0.0])])[None]
    w = cpu_attention.weights(scores)
    got, want = w / mx.sum(w, axis=-1, keepdims=True), mx.softmax(scores, axis=-1)
    assert mx.allclose(got, want, atol=1e-12, rtol=1e-5).item()
    assert got[0, -2].item() == 0.0  # a masked score weighs nothing


def test_small_calls_and_sinks_use_mlx_kernel():
    q, k, v = _inputs(4, 2, 1, 1000)  # a decode step below FEW_FROM_KEYS
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125), cpu_attention._mlx_attention(q, k, v, scale=0.125)).item()
    q, k, v = _inputs(4, 2, 20, 40)  # a short prefill chunk: fewer than SMALL scores
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125, mask="causal"),
                          cpu_attention._mlx_attention(q, k, v, scale=0.125, mask="causal")).item()
    q, k, v = _inputs(4, 2, 3, 100)
    sinks = mx.zeros((4,))
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125, mask="causal", sinks=sinks),
                          cpu_attention._mlx_attention(q, k, v, scale=0.125, mask="causal", sinks=sinks)).item()


@pytest.mark.parametrize("queries,keys", [(3, 100), (5, 9), (16, 700), (2, 2), (4, 300)])
def test_short_steps_take_the_vectorised_path(queries, keys, monkeypatch):
    """Verifies and batched steps at any context below the few-row entry: values within fp32
    rounding of MLX's kernel, for every mask kind a forward hands over (a batch's ragged mask, per
    row)."""
    taken = []
    monkeypatch.setattr(cpu_attention, "vectorised", lambda *a: taken.append(1) or _vectorised(*a))
    q, k, v = _inputs(4, 2, queries, keys, seed=3)
    keep = mx.arange(keys)[None, :] <= mx.arange(keys - queries, keys)[:, None]
    ragged = mx.broadcast_to(keep, (2, 1, queries, keys)) & (mx.arange(keys) < mx.array([keys, keys - 1]).reshape(2, 1, 1, 1) + mx.arange(queries).reshape(1, 1, queries, 1) + 1 - queries)
    ragged = ragged | (mx.arange(keys) == 0)  # every query sees a key
    for mask in ("causal", keep, ragged, mx.where(keep, 0.0, -1e9)):
        want = cpu_attention._mlx_attention(q, k, v, scale=0.125, mask=mask)
        got = cpu_attention.attention(q, k, v, scale=0.125, mask=mask)
        assert mx.allclose(got, want, atol=2e-6, rtol=1e-5).item(), (type(mask), mx.max(mx.abs(got - want)).item())
    assert taken


_vectorised = cpu_attention.vectorised


needs_kernel = pytest.mark.skipif(cpu_attention.kernel()[0] is None, reason=str(cpu_attention.kernel()[1]))


@pytest.fixture
def every_prefill_call(monkeypatch):
    """The kernel for every call past KERNEL_FROM queries, however few scores (small shapes test fast)."""
    monkeypatch.setattr(cpu_attention, "KERNEL_SCORES", 0)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (16, 2, 128), (6, 6, 80), (8, 1, 256), (2, 2, 24)])
def test_the_kernel_matches_mlx_on_prefill_shapes(heads, kv_heads, dim, every_prefill_call):
    """Prefill chunks (more than KERNEL_FROM queries) go to the C kernel; strided views as MLX hands
    them over (a projection transposed to heads, a slice of a preallocated cache) go in as they are."""
    mx.random.seed(1)
    queries, keys = 37, 300
    q = mx.random.normal((2, queries, heads, dim)).transpose(0, 2, 1, 3)  # heads-major view of (B, L, H, D)
    buffer = mx.random.normal((2, kv_heads, 512, dim)) * 2  # a cache's buffer, `keys` of it filled
    k, v = buffer[:, :, :keys], mx.random.normal((2, kv_heads, 512, dim))[:, :, :keys]
    for mask in ("causal", None):
        want = cpu_attention._mlx_attention(q, k, v, scale=dim**-0.5, mask=mask)
        got = cpu_attention.attention(q, k, v, scale=dim**-0.5, mask=mask)
        # fp32 rounding of a 256-long dot product in another order: a few 1e-6 on values of order 1
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (mask, mx.max(mx.abs(got - want)).item())


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_chunk_it_was_computed_in(every_prefill_call):
    """A prompt prefilled in one chunk or in two (a restore resuming mid-prompt) gives each position
    the same attention output, bit for bit: each row's sums run in one order over its own keys."""
    q, k, v = _inputs(4, 2, 96, 96, seed=3)
    whole = cpu_attention.attention(q, k, v, scale=0.125, mask="causal")
    head = cpu_attention.attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], scale=0.125, mask="causal")
    tail = cpu_attention.attention(q[:, :, 40:], k, v, scale=0.125, mask="causal")
    assert mx.array_equal(mx.concatenate([head, tail], axis=2), whole).item()


def test_the_kernel_can_be_switched_off(monkeypatch, every_prefill_call):
    monkeypatch.setenv(cpu_attention.KERNEL_ENV, "off")
    cpu_attention.kernel.cache_clear()
    try:
        assert cpu_attention.kernel() == (None, f"{cpu_attention.KERNEL_ENV}=off")
        q, k, v = _inputs(4, 2, 64, 64)  # the vectorised MLX path instead, same values
        want = cpu_attention._mlx_attention(q, k, v, scale=0.125, mask="causal")
        assert mx.allclose(cpu_attention.attention(q, k, v, scale=0.125, mask="causal"), want, atol=2e-6, rtol=1e-5).item()
    finally:
        cpu_attention.kernel.cache_clear()


@needs_kernel
def test_big_prefill_chunks_take_the_kernel_and_short_steps_at_long_context_its_few_row_entry(monkeypatch):
    taken = []
    fused = cpu_attention._fused
    monkeypatch.setattr(cpu_attention, "_fused", lambda *a, **kw: taken.append((a[1].shape[2], kw.get("few", False)))
                        or fused(*a, **kw))
    for queries, keys in ((256, 1024), (17, 16384), (64, 2000), (16, 8000), (5, 8000), (1, 8000), (5, 1000), (1, 1000)):
        q, k, v = _inputs(4, 2, queries, keys)
        cpu_attention.attention(q, k, v, scale=0.125, mask="causal" if queries > 1 else None)
    # 1M+ scores past 16 queries: the kernel; up to 16 queries over 2k+ keys: its few-row entry;
    # a small chunk, and short steps at short context keep MLX's path
    assert taken == [(256, False), (17, False), (16, True), (5, True), (1, True)]


@pytest.fixture
def every_short_step(monkeypatch):
    """The few-row entry for every call of up to FEW_UP_TO queries, however few keys."""
    monkeypatch.setattr(cpu_attention, "FEW_FROM_KEYS", 0)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (16, 2, 128), (6, 6, 80), (8, 1, 256), (2, 2, 24)])
def test_the_few_row_entry_matches_mlx_on_decode_shapes(heads, kv_heads, dim, every_short_step):
    """Decode steps, verifies and drafts (1-16 queries) over strided views of a cache, as MLX hands
    them over; more rows per key group than the entry takes (8 heads on 1, 16 queries) fall back."""
    mx.random.seed(2)
    for queries, keys in ((1, 37), (1, 700), (4, 700), (16, 300), (5, 9)):
        q = mx.random.normal((2, queries, heads, dim)).transpose(0, 2, 1, 3)
        buffer = mx.random.normal((2, kv_heads, 768, dim)) * 2
        k, v = buffer[:, :, :keys], mx.random.normal((2, kv_heads, 768, dim))[:, :, :keys]
        mask = "causal" if queries > 1 else None
        want = cpu_attention._mlx_attention(q, k, v, scale=dim**-0.5, mask=mask)
        got = cpu_attention.attention(q, k, v, scale=dim**-0.5, mask=mask)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (queries, keys, mx.max(mx.abs(got - want)).item())


@needs_kernel
def test_a_verify_row_has_the_decode_steps_bits(every_short_step):
    """Each query row of a verify over k+1 positions equals, bit for bit, a one-query call at its
    position (the decode step that would have produced it): MTP's rows are AR's."""
    q, k, v = _inputs(4, 2, 5, 900, seed=4)
    verify = cpu_attention.attention(q, k, v, scale=0.125, mask="causal")
    for i in range(5):
        end = 900 - 4 + i
        step = cpu_attention.attention(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], scale=0.125)
        assert mx.array_equal(step, verify[:, :, i:i + 1]).item(), i


@needs_kernel
def test_the_few_row_entry_can_be_switched_off(monkeypatch, every_short_step):
    q, k, v = _inputs(4, 2, 1, 3000)
    monkeypatch.setattr(cpu_attention, "FEW", False)
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125), cpu_attention._mlx_attention(q, k, v, scale=0.125)).item()


@needs_kernel
def test_the_engine_invariants_hold_with_the_kernel_on_every_prefill_chunk(engine, every_prefill_call, monkeypatch):
    """MTP greedy == AR greedy and chunking changes nothing, on both tiny models, with every prefill
    chunk past 16 tokens through the kernel (by default only chunks of 1M+ scores: long prompts)."""
    from test_mtp_exactness import _run
    from mtplx.chat import render
    from mtplx.engine.generation import Generation, StartPoint, events
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus

    convo = conversation(42, Corpus(), Sizes(10, 30), max_user_turns=1)
    prompt = tuple(render(engine.checkpoint.tokenizer, convo["messages"][:4], convo["tools"]))
    taken = []
    fused = cpu_attention._fused
    monkeypatch.setattr(cpu_attention, "_fused", lambda *a: taken.append(a[1].shape[2]) or fused(*a))
    ar = _run(engine, prompt, use_mtp=False)
    mtp = _run(engine, prompt, use_mtp=True, depth=3)
    assert mtp.token_ids == ar.token_ids and taken  # the prompt's 64-token chunks went through the kernel
    outs = []
    for chunk in (17, 100, len(prompt)):
        gen = Generation(engine.runner, GenerationRequest(prompt, SamplingParams(max_tokens=16)), use_mtp=False,
                         depth=1, chunk_size=chunk, eos_ids=engine.eos_ids, submitted_at=0.0)
        outs.append(engine.call(lambda: list(events(gen, StartPoint(), lambda: False)))[-1].token_ids)
    assert outs[0] == outs[1] == outs[2] == ar.token_ids[:16]
    monkeypatch.setattr(cpu_attention, "KERNEL_SCORES", 1 << 60)  # the vectorised MLX path: the same reply
    assert _run(engine, prompt, use_mtp=False).token_ids == ar.token_ids


@needs_kernel
def test_the_engine_invariants_hold_with_the_few_row_entry_on_every_short_step(engine, every_short_step, monkeypatch):
    """MTP greedy == AR greedy on both tiny models with every decode step, verify and draft through
    the few-row entry (by default only at 2k+ keys of context)."""
    from test_mtp_exactness import _run
    from mtplx.chat import render
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus

    convo = conversation(43, Corpus(), Sizes(10, 30), max_user_turns=1)
    prompt = tuple(render(engine.checkpoint.tokenizer, convo["messages"][:4], convo["tools"]))
    taken = []
    fused = cpu_attention._fused
    monkeypatch.setattr(cpu_attention, "_fused", lambda *a, **kw: taken.append(kw.get("few", False)) or fused(*a, **kw))
    ar = _run(engine, prompt, use_mtp=False)
    mtp = _run(engine, prompt, use_mtp=True, depth=3)
    assert mtp.token_ids == ar.token_ids and any(taken)


def test_masks_it_keeps_serve_every_engine_thread():
    """The causal masks cached across calls are data: a lazy one would belong to the stream of the
    thread that built it, and the next engine's thread could not compute it (MLX raised, or aborted)."""
    import threading

    results = []

    def verify():
        with mx.stream(mx.new_stream(mx.cpu)):
            q, k, v = _inputs(4, 2, 3, 40, seed=5)
            got = cpu_attention.attention(q, k, v, scale=0.125, mask="causal")
            results.append(mx.allclose(got, cpu_attention._mlx_attention(q, k, v, scale=0.125, mask="causal"),
                                       atol=2e-6, rtol=1e-5).item())

    for _ in range(2):
        thread = threading.Thread(target=verify)
        thread.start()
        thread.join()
    assert results == [True, True]
