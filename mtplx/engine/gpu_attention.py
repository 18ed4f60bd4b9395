"""Short query blocks over a cache on MLX's CUDA backend, without a per-shape attention build.

On CUDA, MLX runs `mx.fast.scaled_dot_product_attention` for more than one query through a path
that is built for each new (queries, keys) shape and cached: measured on an H200 (MLX 0.32.4,
tiny-dense), a 4-token forward over a cache took 57-120 ms at each cache length not seen before
and 3.6-4.9 ms at one seen before. An MTP verify (k+1 queries) meets a new cache length nearly
every round, so MTP decoded at 11-62 tok/s where AR (one query: a kernel for any length) did 650.
The short blocks (2..SHORT queries: verify, the MTP head's pending pairs, small batch steps)
therefore run as plain products and a softmax, which take any length; one query and prefill
chunks keep MLX's kernel. Metal and the CPU are left alone (the CPU has cpu_attention.py).
MTPLX_GPU_ATTENTION=off keeps MLX's kernel for every call.
"""

from __future__ import annotations

import os

import mlx.core as mx

from mtplx.engine.cpu_attention import grouped

ENV = "MTPLX_GPU_ATTENTION"
SHORT = 16  # queries: compiled.STEP_TOKENS, the longest short step
_mlx_attention = mx.fast.scaled_dot_product_attention


def wanted() -> bool:
    """On MLX's CUDA backend, unless switched off."""
    on = os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")
    cuda = getattr(mx, "cuda", None)
    return on and mx.default_device() != mx.cpu and cuda is not None and cuda.is_available()


def _precise_softmax(scores: mx.array) -> mx.array:
    return mx.softmax(scores, axis=-1, precise=True)  # fp32 inside for bf16 scores, as MLX's kernel


def attention(q, k, v, *, scale, mask=None, sinks=None, stream=None):
    """Same contract as mx.fast.scaled_dot_product_attention."""
    L = q.shape[2]
    if 1 < L <= SHORT and sinks is None and stream is None and q.shape[1] % k.shape[1] == 0:
        return grouped(q, k, v, scale, mask, _precise_softmax)
    kwargs = {"stream": stream} if stream is not None else {}
    return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)


def install() -> None:
    """Route the process's attention calls through `attention` (MLX's CUDA backend only)."""
    mx.fast.scaled_dot_product_attention = attention
