"""Attention over several query positions on MLX's CPU backend, about twice as fast as
`mx.fast.scaled_dot_product_attention` there.

On the CPU, MLX's fused attention is a composition whose cost at agent context lengths is two
things: its softmax runs MLX's scalar `exp` (~40-66 M values/s here, a sixth of numpy's), and a
grouped-query head's keys are broadcast per query head, so the score and value products become
small batched GEMMs with copies. Both matter most exactly where mtplx spends its time: prefill
chunks at thousands of tokens of context (render-ahead, a strip turn, Codex's resend) and the
MTP verify over k+1 positions. This version folds each key group's query heads into the rows of
one GEMM against the group's keys (no broadcast), and takes the exponent as 2^n * p(f) from MLX's
vectorised arithmetic (relative error < 4e-7). `python bench/attention.py` on this 2-core CPU with
MKL, side by side: 16-64 queries over 1k-8k keys 2.0x, 5 over 2k 1.8x; on tiny-dense a 16-token
prefill chunk at 2k / 8k tokens of context 1.54x / 1.68x, a 64-token one 1.39x / 1.82x. A verify
(2-16 queries) takes it at any context: MTP rounds 1.10-1.18x alone and 1.20-1.27x four rows at
once on tiny-dense (bench/verify_attention.py). One-query calls (AR decode, a draft step) and
short prefill chunks under SMALL scores keep MLX's kernel: as fast there.

Big prefill chunks (more than KERNEL_FROM queries and KERNEL_SCORES scores, no mask or a causal
one) go further, to a C kernel (mtplx/native/attention.c) that computes scores, softmax and values
per block of rows on two threads without a score matrix in memory: on tiny-dense a cold 3k-token
prefill took 0.9 s instead of 1.5 s (attention was three quarters of it). Among the calls it
takes, each row's bits are the same whatever call it came in. MTPLX_ATTENTION_KERNEL=off keeps
the MLX path for them. The short steps at 2k+ keys take its entry for a few query rows (FEW_*).

Installed only on the CPU backend with fp32 compute (the fast path): every attention call of the
process then goes through it, so cold, restored, AR, MTP and batched paths all compute with one
function for a given call shape (the exactness tests hold on it). Sinks, other dtypes and
one-query calls below the few-row entry fall through to MLX's kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os

import mlx.core as mx
import numpy as np

from mtplx import native_build
from mtplx.engine import batch_cache

_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 below 2**22 to an integer, in the low mantissa bits
# A masked score: finite, as MLX's kernel uses, so a query that sees no key (a batch row's left
# padding) averages the values as there instead of giving NaN.
_MASKED = float(mx.finfo(mx.float32).min)


def _exponent_bits(scores: mx.array, c: mx.array) -> tuple[mx.array, mx.array]:
    """e^(x - max) per row as 2^n * 2^f, with y = (x - max) * c in base 2 (c: the call's scale times
    log2 e, so the scale costs no op of its own), n = round(y), f = y - n in [-1/2, 1/2]. Returns
    2^f (a degree-5 polynomial, relative error < 4e-7) and the int32 bit pattern of 2^n."""
    # clamped where 2^n leaves the normal range: n = -127 builds exponent bits 0, a weight of exactly 0
    y = mx.maximum((scores - mx.max(scores, axis=-1, keepdims=True)) * c, -127.0)
    n = (y + _ROUND) - _ROUND
    f = y - n
    p = 1.3333558e-3
    p = p * f + 9.6180883e-3
    p = p * f + 5.5504110e-2
    p = p * f + 2.4022650e-1
    p = p * f + 6.9314718e-1
    return p * f + 1.0, (n.astype(mx.int32) + 127) << 23


def _kept_exponent_bits(scores: mx.array, keep: mx.array, c: mx.array) -> tuple[mx.array, mx.array]:
    return _exponent_bits(mx.where(keep, scores, _MASKED), c)


# Shapeless: the key count grows by one every decode step and by a chunk every prefill chunk, and
# a compile per shape would cost more than it saves. A bit view cannot be traced, so 2^n's bits
# leave the first kernel and the second multiplies by them viewed as floats.
_exponent = mx.compile(_exponent_bits, shapeless=True)
_kept_exponent = mx.compile(_kept_exponent_bits, shapeless=True)
_times = mx.compile(lambda p, power: p * power, shapeless=True)


def weights(scores: mx.array, keep: mx.array | None = None, c: float = _LOG2E) -> mx.array:
    """Unnormalised softmax weights e^((x - max) c / log2 e) over the last axis (0 where `keep` is
    False, unless a row keeps nothing: then every weight is 1, as with MLX's kernel); the max weight
    of a row is exactly 1."""
    if scores.shape[-1] == 1:
        # One key: its weight is 1. (MLX 0.32's shapeless compile corrupts the heap reducing an
        # axis of size 1, so such rows never reach the compiled kernel.)
        return mx.ones_like(scores)
    p, bits = _exponent(scores, _constant(c)) if keep is None else _kept_exponent(scores, keep, _constant(c))
    return _times(p, bits.view(mx.float32))


@functools.lru_cache(maxsize=16)
def _constant(c: float) -> mx.array:
    return mx.array(c, dtype=mx.float32)


@functools.lru_cache(maxsize=8)
def _causal(queries: int, keys: int) -> mx.array:
    """Query j (of the last `queries` positions) sees keys up to its own position; (1,1,1,L,S).
    Every layer of a forward asks for the same shape: built once per forward, not per layer. Built
    on the host, as data: a lazy array kept here would belong to the stream of the thread that
    made it, and another engine's thread could not compute it."""
    keep = np.arange(keys)[None, :] <= np.arange(keys - queries, keys)[:, None]
    return mx.array(keep[None, None, None])


_mlx_attention = mx.fast.scaled_dot_product_attention
# Which calls the vectorised path takes (the rest keep MLX's kernel). From 2 to FEW_UP_TO queries
# (a verify, a batch's verify, a short prefill chunk), at any context below the few-row entry: as
# fast as MLX's kernel over 100 keys and faster past that (bench/verify_attention.py). One query
# (an AR step, a draft) keeps MLX's kernel: alone the vectorised call was as fast from ~300 keys
# on, but inside a decode step its extra dispatches cost more than its exponents save (AR 0.92x
# at 600 keys, 0.96x at 1,500, side by side in one process). Longer calls (prefill chunks) take
# it from SMALL scores: below, the exponent is not what they cost.
SMALL = 4096
SHORT = True  # False: 2-16-query calls keep MLX's kernel below the few-row entry (bench/verify_attention.py)

# Calls of more than KERNEL_FROM queries and at least KERNEL_SCORES scores, with no mask or a causal
# one (prefill chunks), go to the C kernel (mtplx/native/attention.c): it fuses scores, softmax and
# values per block of rows, on two threads. It needs the call's inputs computed, a sync inside the
# forward that costs MLX its overlap of building and computing: the short steps (decode, verify,
# draft: at most compiled.STEP_TOKENS queries) keep the MLX path below, and so do smaller chunks.
# On tiny-dense (4 heads) a 64-token chunk at 2k tokens of context (512k scores) measured 0.85-0.95x
# of the vectorised path through the kernel, at 8k (2M) 1.35x, 256-token chunks at 1k+ 2x and more.
KERNEL_FROM = 16
KERNEL_SCORES = 1 << 20

# The short steps (decode, verify, draft: up to FEW_UP_TO queries) at FEW_FROM_KEYS keys and more
# go to the kernel's entry for a few query rows (`mtplx_attention_few`): it reads keys and values
# in place, once, and a row's bits do not depend on the call's query count, so a verify's rows
# are the decode step's. Alone, 4 heads over 2 key heads: one query over 3k / 8k keys 0.18 /
# 0.46 ms against MLX's 0.36 / 0.88, four 0.35 / 0.71 against 0.64 / 1.40. In a forward it pays
# the sync too: on tiny-dense, side by side (bench/decode_attention.py), an MTP round at depth 3
# over 300 keys took 3.51 ms with it against 2.92, over 1k 4.84 against 4.62, over 3k 6.32
# against 7.51, over 7k 9.91 against 12.78; hence the threshold.
FEW_UP_TO = 16  # queries: compiled.STEP_TOKENS
FEW_FROM_KEYS = 2048
FEW = True  # bench/decode_attention.py switches it for its side-by-side
RAGGED_ROWS = True  # a long ragged batch row by row (attention below); switched for side-by-side runs
KERNEL_ENV = native_build.ATTENTION_ENV
_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


@functools.cache
def kernel() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded attention kernel, None), or (None, why not)."""
    if (why := native_build.attention_unavailable()) is not None:
        return None, why
    lib, why = native_build.ATTENTION.load()
    if lib is None:
        return None, why
    try:
        entries = lib.mtplx_attention, lib.mtplx_attention_few, lib.mtplx_attention_rows
    except AttributeError:  # a library under the cached name that is not this kernel
        return None, f"{native_build.ATTENTION.built()} lacks mtplx_attention"
    for entry in entries:
        entry.restype = ctypes.c_int
        entry.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 3) * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 6 + \
            [ctypes.c_float, ctypes.c_int, ctypes.c_int] + ([ctypes.c_void_p] if entry is entries[2] else [])
    return lib, None


def _fused(lib, q, k, v, scale: float, causal: bool, few: bool = False, row_keys: list[int] | None = None) -> mx.array | None:
    """The kernel's attention (None: it declined the shapes, or had no memory); `few`: its entry
    for a few query rows per key group, which reads the keys in place; `row_keys`: that entry over
    a ragged batch, row b over its first row_keys[b] keys."""
    mx.eval(q, k, v)
    views = []
    for a in (q, k, v):
        try:
            view = np.array(a, copy=False)  # MLX's buffer: a strided view of the cache, no copy
        except (ValueError, TypeError):
            view = np.array(a)
        if view.strides[-1] != 4 or any(st % 4 for st in view.strides):
            view = np.ascontiguousarray(view)
        views.append(view)
    (B, Hq, L, D), S = q.shape, k.shape[2]
    out = np.empty((B, Hq, L, D), np.float32)
    args = []
    for view in views:
        args += [view.ctypes.data, *(st // 4 for st in view.strides[:3])]
    if row_keys is not None:
        keys = np.array(row_keys, np.int32)
        failed = lib.mtplx_attention_rows(*args, out.ctypes.data, B, Hq, k.shape[1], L, S, D, scale, int(causal), _THREADS,
                                          keys.ctypes.data)
    else:
        entry = lib.mtplx_attention_few if few else lib.mtplx_attention
        failed = entry(*args, out.ctypes.data, B, Hq, k.shape[1], L, S, D, scale, int(causal), _THREADS)
    return None if failed else mx.array(out)


def _kernel_takes(q, k, v, mask, sinks, stream) -> bool:
    """fp32, no mask or a causal one, keys and values of the queries' width (not MLA's latent
    values), whole key groups, head dims in 8s."""
    B, Hq, L, D = q.shape
    causal = isinstance(mask, str) and mask == "causal"
    return (sinks is None and stream is None and (mask is None or (causal and L <= k.shape[2]))
            and q.dtype == k.dtype == v.dtype == mx.float32 and k.shape == v.shape and k.shape[0] == B
            and k.shape[3] == D and D % 8 == 0 and not Hq % k.shape[1])


def attention(q, k, v, *, scale, mask=None, sinks=None, stream=None):
    """Same contract as mx.fast.scaled_dot_product_attention (q: B, Hq, L, D; k, v: B, Hkv, S, D;
    mask "causal", a boolean keep-mask or an additive one, broadcastable to B, Hq, L, S)."""
    B, Hq, L, D = q.shape
    S = k.shape[2]
    if RAGGED_ROWS and L <= FEW_UP_TO and S >= FEW_FROM_KEYS and isinstance(mask, mx.array) and k.shape[0] == B:
        lengths = batch_cache.ragged_lengths(mask)
        if lengths is not None and len(lengths) == B:
            # A ragged batch at long context: each row over its own keys with the mask it has alone,
            # so each takes the call it takes alone (the few-row entry past the threshold, which a
            # batched call with a mask cannot), its bits are its bits alone, and a short row no
            # longer attends over the longest row's length of masked slots. Rows that all take the
            # entry go in one call of it (one sync), summed row by row as alone.
            own = [n + L for n in lengths]
            causal = "causal" if L > 1 else None
            if (FEW and min(own) >= FEW_FROM_KEYS and _kernel_takes(q, k, v, causal, sinks, stream)
                    and (lib := kernel()[0]) is not None):
                if (out := _fused(lib, q, k, v, scale, causal is not None, few=True, row_keys=own)) is not None:
                    return out
            return mx.concatenate([attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=scale,
                                             mask=causal, sinks=sinks, stream=stream) for b, n in enumerate(own)])
    if (L > KERNEL_FROM and Hq * L * S >= KERNEL_SCORES and _kernel_takes(q, k, v, mask, sinks, stream)
            and (lib := kernel()[0]) is not None):
        if (out := _fused(lib, q, k, v, scale, mask is not None)) is not None:
            return out
    if (FEW and L <= FEW_UP_TO and S >= FEW_FROM_KEYS and _kernel_takes(q, k, v, mask, sinks, stream)
            and (lib := kernel()[0]) is not None):
        if (out := _fused(lib, q, k, v, scale, mask is not None, few=True)) is not None:
            return out
    mlx_kernel = L == 1 or (L <= FEW_UP_TO and not SHORT) or (L > FEW_UP_TO and Hq * L * S < SMALL)
    if mlx_kernel or sinks is not None or stream is not None or q.dtype != mx.float32 or Hq % k.shape[1]:
        kwargs = {"stream": stream} if stream is not None else {}
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return vectorised(q, k, v, scale, mask)


def vectorised(q, k, v, scale, mask=None):
    """Attention with a key group's query heads as the rows of one product with its keys (no key
    broadcast per head), weights from `weights` (the mask and the scale inside its kernel) and the
    normalisation after the product with the values (L x D divisions, not L x S)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    scores = (q.reshape(B, Hkv, rep * L, D) @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, L, S)
    c = scale * _LOG2E
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        w = weights(scores, _causal(L, S), c)
    elif mask is None:
        w = weights(scores, None, c)
    else:
        grouped_mask = _grouped(mask, Hq, Hkv, rep)
        if mask.dtype == mx.bool_:
            w = weights(scores, grouped_mask, c)
        else:  # additive: applied to the scaled scores, as MLX's kernel does
            w = weights(scores * scale + grouped_mask.astype(scores.dtype), None, _LOG2E)
    w = w.reshape(B, Hkv, rep * L, S)
    out = (w @ v) / mx.sum(w, axis=-1, keepdims=True)
    return out.reshape(B, Hq, L, v.shape[-1])  # MLA: values narrower than keys


def _grouped(mask: mx.array, Hq: int, Hkv: int, rep: int) -> mx.array:
    """A mask given for (…, Hq or 1, L or 1, S), laid out to broadcast over (B, Hkv, rep, L, S)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim < 4 else mask
    b, h, lq, s = mask.shape
    return mask.reshape(b, Hkv, rep, lq, s) if h == Hq and Hq > 1 else mask[:, :, None]


def grouped(q, k, v, scale, mask, normalise):
    """Attention as a key group's query heads stacked into the rows of one product with its keys
    (no key broadcast per head); `normalise` is the softmax over the last axis."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    rows = (q * scale).reshape(B, Hkv, rep * L, D)  # a group's query heads as rows: heads h = g * rep + r
    scores = rows @ k.swapaxes(-1, -2)  # B, Hkv, rep * L, S
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        position = mx.tile(mx.arange(S - L, S), rep)[:, None]
        scores = mx.where(mx.arange(S)[None, :] <= position, scores, _MASKED)
    elif mask is not None:
        scores = _masked(scores, mask, B, Hq, Hkv, rep, L, S)
    return (normalise(scores) @ v).reshape(B, Hq, L, v.shape[-1])  # MLA: values narrower than keys


def _masked(scores, mask, B, Hq, Hkv, rep, L, S):
    """Apply a mask given for (…, Hq or 1, L, S) to scores laid out as (B, Hkv, rep * L, S)."""
    mask = mx.broadcast_to(mask, mask.shape[:-2] + (L, S)) if mask.shape[-2] != L else mask
    if mask.ndim == 4 and mask.shape[1] == Hq and Hq > 1:
        mask = mask.reshape(mask.shape[0], Hkv, rep * L, S)
    elif rep > 1:
        mask = mx.tile(mask, (1,) * (mask.ndim - 2) + (rep, 1))
    return mx.where(mask, scores, _MASKED) if mask.dtype == mx.bool_ else scores + mask.astype(scores.dtype)


def install() -> None:
    """Route the process's attention calls through `attention` (the CPU fast path only)."""
    mx.fast.scaled_dot_product_attention = attention
