"""The GatedDeltaNet recurrence over a prefill chunk, in matrix form (the chunked delta rule).

Per head, with state S (Dv x Dk), each position t does
    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t.
Step by step that is thousands of tiny dependent ops per prefill chunk on the CPU (mlx-lm's
`gated_delta_ops`; gdn_capture.py compiles blocks of them): ~35 ms per 256 tokens per layer here,
two thirds of a tiny-hybrid forward. Within a block of C positions the u's solve one unit lower-
triangular system, (I + diag(beta) A) U = diag(beta) (V - diag(gamma) K S0^T) with
A_ij = (gamma_i / gamma_j) k_i.k_j for j < i and gamma the running decay, so a block costs a few
C x C and C x D matmuls and only the state between blocks is sequential (~8 ms per 256 tokens).

The arithmetic differs from the step function's order (same values to fp32 rounding, ~1e-6
relative: tests/test_gdn_prefill.py), so it runs only where rows are not bitwise anyway: CPU fp32
on MKL (fast_path.rows_bitwise). Decode steps and the MTP verify keep the step function.
"""

from __future__ import annotations

import mlx.core as mx

from mtplx.engine.compute import blas_threads

C = 64  # positions per block


def _within_blocks(q, k, v, log_g, beta):
    """What each block needs that does not depend on the state entering it. Inputs are
    [B, H, n, C, ...] (n blocks); returns the terms `_across` combines with that state."""
    G = mx.cumsum(log_g, axis=-1)  # log of the decay from the block's start through position i
    idx = mx.arange(C)
    lower, strict = idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]
    # gamma_i / gamma_j for j <= i; the upper triangle is zeroed before exp so it cannot overflow
    decay = mx.where(lower, mx.exp(mx.where(lower, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    system = mx.eye(C) + mx.where(strict, decay * (k @ k.swapaxes(-1, -2)), 0.0) * beta[..., None]
    gamma = mx.exp(G)
    # Forward substitution (LAPACK's trsm), one solve for both right-hand sides. Not the inverse
    # as a product of (I + L^2^m) factors: with correlated keys and slow decay those powers grow
    # combinatorially and cancel, and the outputs came out 10^4 times too large.
    rhs = mx.concatenate([beta[..., None] * v, (beta * gamma)[..., None] * k], axis=-1)
    solved = mx.linalg.solve_triangular(system.reshape(-1, C, C), rhs.reshape(-1, C, rhs.shape[-1]),
                                        upper=False, stream=mx.cpu).reshape(rhs.shape)
    values, keys = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]  # U = values - keys @ S0^T
    scores = decay * (q @ k.swapaxes(-1, -2))
    to_end = mx.exp(G[..., -1:] - G)[..., None] * k  # each key decayed to the block's end
    return values, keys, scores, gamma[..., None] * q, to_end, mx.exp(G[..., -1])


def _across(values, keys, scores, gated_q, to_end, block_decay, state):
    """One block given the state entering it: (outputs [B, H, C, Dv], the state after it)."""
    entering = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    u = values - keys @ entering
    y = gated_q @ entering + scores @ u
    return y, block_decay[..., None, None] * state + u.swapaxes(-1, -2) @ to_end


_across_compiled = mx.compile(_across)


def recurrence(q, k, v, log_g, beta, state):
    """q, k [B, T, H, Dk] (k L2-normalised, q scaled, heads repeated to H), v [B, T, H, Dv],
    log_g and beta [B, T, H], state [B, H, Dv, Dk] fp32 -> (y [B, T, H, Dv], final state), both
    evaluated. The input projections are evaluated first on the BLAS threads the caller has; the
    block math, hundreds of small matmuls, on one (each MKL call wakes its threads: 2 threads ran
    this 2-5x slower)."""
    mx.eval(q, k, v, log_g, beta, state)
    B, T, H, Dk = q.shape
    pad = -T % C  # padded positions: no decay, no write (beta 0, k 0), outputs dropped

    def blocks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, (T + pad) // C, C, *x.shape[2:])
        return mx.moveaxis(x, 3, 1)

    with blas_threads(1):
        terms = _within_blocks(*(blocks(x) for x in (q, k, v, log_g, beta)))
        ys = []
        for n in range(terms[0].shape[2]):
            y, state = _across_compiled(*(t[:, :, n] for t in terms), state)
            ys.append(y)
        y = mx.concatenate(ys, axis=2)[:, :, :T].swapaxes(1, 2)
        mx.eval(y, state)
    return y, state
