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
prefill chunk at 2k / 8k tokens of context 1.54x / 1.68x, a 64-token one 1.39x / 1.82x. Calls with
fewer than SMALL scores (AR decode, a verify at short context) keep MLX's kernel: as fast there.

Big prefill chunks (more than KERNEL_FROM queries and KERNEL_SCORES scores, no mask or a causal
one) go further, to a C kernel (mtplx/native/attention.c) that computes scores, softmax and values
per block of rows on two threads without a score matrix in memory: on tiny-dense a cold 3k-token
prefill took 0.9 s instead of 1.5 s (attention was three quarters of it). Among the calls it
takes, each row's bits are the same whatever call it came in. MTPLX_ATTENTION_KERNEL=off keeps
the MLX path for them. The short steps at 2k+ keys take its entry for a few query rows (FEW_*).

Installed only on the CPU backend with fp32 compute (the fast path): every attention call of the
process then goes through it, so cold, restored, AR, MTP and batched paths all compute with the
same function (the exactness tests hold on it). Sinks, other dtypes and one-query calls fall
through to MLX's kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os

import mlx.core as mx
import numpy as np

from mtplx import native_build

_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 below 2**22 to an integer, in the low mantissa bits
_BIAS_BITS = 0x4B400000  # the bit pattern of _ROUND itself
# A masked score: finite, as MLX's kernel uses, so a query that sees no key (a batch row's left
# padding) averages the values as there instead of giving NaN.
_MASKED = float(mx.finfo(mx.float32).min)


def _scaled_exponent(scores: mx.array) -> tuple[mx.array, mx.array]:
    """e^(x - max) = 2^n * 2^f, n = round((x - max) log2 e), f in [-1/2, 1/2]: returns 2^f (a
    degree-5 polynomial, relative error < 4e-7) and n + _ROUND, whose low mantissa bits hold n."""
    # clamped where 2^n leaves the normal range: n = -127 builds exponent bits 0, a weight of exactly 0
    y = mx.maximum((scores - mx.max(scores, axis=-1, keepdims=True)) * _LOG2E, -127.0)
    t = y + _ROUND
    f = y - (t - _ROUND)
    p = 1.3333558e-3
    p = p * f + 9.6180883e-3
    p = p * f + 5.5504110e-2
    p = p * f + 2.4022650e-1
    p = p * f + 6.9314718e-1
    return p * f + 1.0, t


def _normalised(p: mx.array, scale: mx.array) -> mx.array:
    e = p * scale
    return e / mx.sum(e, axis=-1, keepdims=True)


# Shapeless: the key count grows by one every decode step and by a chunk every prefill chunk, and
# a compile per shape would cost more than it saves. (A bit view cannot be traced shapeless, so
# building 2^n in the exponent bits sits between the two compiled halves.)
_exponent = mx.compile(_scaled_exponent, shapeless=True)
_normalise = mx.compile(_normalised, shapeless=True)


def softmax(scores: mx.array) -> mx.array:
    p, t = _exponent(scores)
    return _normalise(p, ((t.view(mx.int32) - _BIAS_BITS + 127) << 23).view(mx.float32))


_mlx_attention = mx.fast.scaled_dot_product_attention
# Below this many scores per row MLX's kernel is as fast (a verify at short context, AR decode):
# the exponent is not what such a call costs. Measured on one MKL thread (a verify's), 4 query
# heads over 2 key heads: MLX / this at 3-4 queries over 400-900 keys 1.2-1.6x, over 100-200 keys
# 0.3-1.0x; the crossover sits near 4k scores. At 16k (the first threshold) a verify over
# 300-1,400 keys kept MLX's kernel: in one process, alternating, an MTP round at ~500 tokens of
# context took 3.31 ms with it and 2.59 ms with this, a 4-row batch's round 8.21 and 6.71 ms.
SMALL = 4096


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
        entries = lib.mtplx_attention, lib.mtplx_attention_few
    except AttributeError:  # a library under the cached name that is not this kernel
        return None, f"{native_build.ATTENTION.built()} lacks mtplx_attention"
    for entry in entries:
        entry.restype = ctypes.c_int
        entry.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 3) * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 6 + \
            [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib, None


def _fused(lib, q, k, v, scale: float, causal: bool, few: bool = False) -> mx.array | None:
    """The kernel's attention (None: it declined the shapes, or had no memory); `few`: its entry
    for a few query rows per key group, which reads the keys in place."""
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
    entry = lib.mtplx_attention_few if few else lib.mtplx_attention
    if entry(*args, out.ctypes.data, B, Hq, k.shape[1], L, S, D, scale, int(causal), _THREADS):
        return None
    return mx.array(out)


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
    if (L > KERNEL_FROM and Hq * L * k.shape[2] >= KERNEL_SCORES and _kernel_takes(q, k, v, mask, sinks, stream)
            and (lib := kernel()[0]) is not None):
        if (out := _fused(lib, q, k, v, scale, mask is not None)) is not None:
            return out
    if (FEW and L <= FEW_UP_TO and k.shape[2] >= FEW_FROM_KEYS and _kernel_takes(q, k, v, mask, sinks, stream)
            and (lib := kernel()[0]) is not None):
        if (out := _fused(lib, q, k, v, scale, mask is not None, few=True)) is not None:
            return out
    if (L == 1 or Hq * L * k.shape[2] < SMALL or sinks is not None or stream is not None or q.dtype != mx.float32
            or Hq % k.shape[1]):
        kwargs = {"stream": stream} if stream is not None else {}
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return grouped(q, k, v, scale, mask, softmax)


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
