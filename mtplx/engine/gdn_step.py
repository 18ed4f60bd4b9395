"""One position of the GatedDeltaNet recurrence: the arithmetic every mtplx step path shares.

Per value head, with state S (Dv x Dk), decay g, write strength beta:
    S' = g S + (beta (v - g S k)) k^T,   y = S' q.
mlx-lm's CPU step (`gated_delta._gated_delta_step_ops`) forms S k and S' q as broadcast products
summed over the last axis. On MLX's CPU backend such a reduction cost ~18 us at tiny-hybrid's
shapes (4 heads of 64 x 64) against ~6 us for the same product as a matmul, and a decode step
runs two per position in every recurrent layer. As matmuls, a layer's recurrence over a 4-token
verify took 0.40 ms instead of 0.51-0.56, and 0.57 instead of 0.99 for four rows at once; on
tiny-hybrid, side by side: AR decode 1.01-1.09x, MTP 1.04-1.06x, four sessions 1.08-1.14x
(bench/gdn_step.py).

Bits: each product is one GEMM per (row, head) of a fixed shape (1 x Dk times Dk x Dv), whatever
the number of positions or rows in the call, and equal shapes give equal bits (the small-row
kernel, MKL with CBWR, MLX's own loops). So a verify's kept state is an AR feed's, and a batch
row is the row alone (tests/test_gdn_step.py). It differs from mlx-lm's step in the last bits
(the order of the sums), which is why every mtplx recurrence that must agree with a decode step
uses this function: the compiled steps (compiled.py), the capturing verify and the prefill blocks
(gdn_capture.py). Only the prefill's matrix form (gdn_prefill.py) computes otherwise, where rows
are not bitwise anyway.
"""

from __future__ import annotations

import os

import mlx.core as mx

# MTPLX_GDN_STEP=reductions computes as mlx-lm's step does (bit for bit): the other arm of
# bench/gdn_step.py's side-by-side. Read once, at import: every path of a process must agree.
REDUCTIONS = os.environ.get("MTPLX_GDN_STEP", "").strip().lower() == "reductions"


def step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array):
    """q, k: [..., H, Dk]; v: [..., H, Dv]; g, beta: [..., H]; state: [..., H, Dv, Dk] (float32).
    Returns (y [..., H, Dv] in q's type, as mlx-lm's step, and the state after this position)."""
    return (_reductions if REDUCTIONS else _matmuls)(q, k, v, g, beta, state)


def _matmuls(q, k, v, g, beta, state):
    out_type = q.dtype
    # In the state's type: MLX's mixed-type matmul (bf16 keys by float32 state) gave a row other
    # bits in a batch of four than alone; cast first, every call is one float32 GEMM shape.
    q, k, v = (a.astype(state.dtype) for a in (q, k, v))
    decayed = state * g[..., None, None]
    keys = k[..., None, :]  # [..., H, 1, Dk]: a one-row matrix per head
    delta = (v[..., None, :] - keys @ decayed.swapaxes(-1, -2)) * beta[..., None, None]  # [..., H, 1, Dv]
    state = decayed + delta.swapaxes(-1, -2) * keys
    return (q[..., None, :] @ state.swapaxes(-1, -2))[..., 0, :].astype(out_type), state


def _reductions(q, k, v, g, beta, state):
    """mlx-lm's `_gated_delta_step_ops` arithmetic, in its order (scalar gating, no mask)."""
    state = state * g[..., None, None]
    delta = (v - (state * k[..., None, :]).sum(axis=-1)) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    return (state * q[..., None, :]).sum(axis=-1).astype(q.dtype), state
