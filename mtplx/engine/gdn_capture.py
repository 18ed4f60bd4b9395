"""Per-position GatedDeltaNet states inside one multi-token forward (the MTP verify).

A recurrent state cannot be trimmed like attention KV: after a verify over k+1 tokens of which
only j+1 are kept, the conv tail and the recurrent state must be what feeding only those tokens
would give. Rather than replaying the kept tokens, the verify forward records the state after
every position, and rollback picks the right one.

Every path here runs gdn_step's step function position by position, as the compiled decode
steps do (compiled.py), so a kept state is bit-identical to the one an autoregressive feed
produces. Only mlx-lm's `qwen3_5` GatedDeltaNet is handled; other
recurrent layers fall back to snapshot-and-replay (see `rollback.py`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from mtplx.engine import fast_silu, gdn_prefill, gdn_step


# A prefill chunk's recurrence runs in compiled blocks of this many positions. Step by step it
# dispatches several ops per position per layer, so a 256-token chunk was thousands of tiny ops;
# compiled, a block's elementwise steps fuse into a few kernels. The arithmetic is the same step
# function in the same order (bit-identical, tests/test_compiled_steps.py).
BLOCK = 16


def _recurrence(q, k, v, g, beta, state):
    """gdn_step's step over each position of the inputs, in order: (ys, final state)."""
    ys = []
    for t in range(q.shape[1]):
        y, state = gdn_step.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


_block = mx.compile(_recurrence)


class CapturingGatedDeltaNet(GatedDeltaNet):
    """Same weights; outputs equal mlx-lm's to float32 rounding (gdn_step sums in another order).
    When `cache.capture` is set it also fills `cache.positions`
    with (conv_tail, recurrent_state) after each input position, and with `cache.stops` (input
    positions) it fills `cache.stopped` {stop: (conv_tail, state)} there. A longer input without capture
    (a prefill chunk) runs its recurrence in matrix form where `chunked` is set (gdn_prefill.py),
    else in compiled blocks of the step function."""

    chunked = False
    vector_silu = False  # the convolution's SiLU is fast_silu's (the model's MLPs compute theirs so)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        capture = cache is not None and getattr(cache, "capture", False)
        stops = getattr(cache, "stops", ()) if cache is not None else ()
        # mlx-lm's own forward only where a batch's padding is masked: elsewhere every input runs
        # gdn_step's arithmetic, the one the compiled decode steps use (a state left by a short
        # feed here must equal theirs bit for bit).
        if cache is None or mask is not None or cache.lengths is not None:
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        keep = self.conv_kernel_size - 1
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        conv_state = cache[0] if cache[0] is not None else mx.zeros((B, keep, self.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = (fast_silu.silu if self.vector_silu else nn.silu)(self.conv1d(conv_input))
        sizes = [self.key_dim, 2 * self.key_dim]
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(mx.split(conv_out, sizes, -1),
                               [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                               [self.head_k_dim, self.head_k_dim, self.head_v_dim])
        ]
        q, k = gated_delta.normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        beta = mx.sigmoid(self.in_proj_b(inputs))
        a = self.in_proj_a(inputs)
        g = gated_delta.compute_g(self.A_log, a, self.dt_bias)  # lazy: unused by the matrix form
        state = cache[1] if cache[1] is not None else mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
        if (repeat := self.num_v_heads // self.num_k_heads) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        ys, positions = [], []
        if capture:
            for t in range(S):
                y, state = gdn_step.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
                ys.append(y[:, None])
                positions.append((conv_input[:, t + 1 : t + 1 + keep, :], state))
            cache.positions = positions
        else:
            # The input runs in segments that end at the stops (the bank's checkpoints inside this
            # forward); the state at each is kept, as a forward that ended there would leave it.
            if self.chunked:  # the log of compute_g's g, which the matrix form decays by
                log_g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias)
            cache.stopped, begin = {}, 0
            for end in (*stops, S):
                # Up to a block, the step function: what compiled.py's steps run, bit for bit.
                if self.chunked and end - begin > BLOCK:
                    y, state = gdn_prefill.recurrence(q[:, begin:end], k[:, begin:end], v[:, begin:end],
                                                      log_g[:, begin:end], beta[:, begin:end], state)
                    ys.append(y)
                else:
                    for s in range(begin, end, BLOCK):
                        e = min(s + BLOCK, end)
                        run = _block if e - s == BLOCK else _recurrence  # a short tail: not worth a compile per length
                        y, state = run(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
                        ys.append(y)
                if end < S:
                    cache.stopped[end] = (conv_input[:, end:end + keep, :], state)
                begin = end
        cache[0], cache[1] = mx.contiguous(conv_input[:, -keep:, :]), state
        cache.advance(S)
        out = self.out_proj(self.norm(mx.concatenate(ys, axis=1), z).reshape(B, S, -1))
        if self.sharding_group is not None:  # tensor parallel: each rank holds some heads (as mlx-lm sums)
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


def install(model, chunked: bool = False, vector_silu: bool | None = None) -> bool:
    """Switch every qwen3_5 GatedDeltaNet of `model` to the capturing class (same parameters),
    prefilling in matrix form if `chunked`, its convolution's SiLU fast_silu's if `vector_silu`
    (None: as the layer has it, the class default off). Returns whether all recurrent layers can
    now capture."""
    layers = getattr(model, "layers", [])
    recurrent = [layer for layer in layers if hasattr(layer, "linear_attn")]
    for layer in recurrent:
        if type(layer.linear_attn) is GatedDeltaNet:
            layer.linear_attn.__class__ = CapturingGatedDeltaNet
        if isinstance(layer.linear_attn, CapturingGatedDeltaNet):
            layer.linear_attn.chunked = chunked
            if vector_silu is not None:
                layer.linear_attn.vector_silu = vector_silu
    return all(isinstance(layer.linear_attn, CapturingGatedDeltaNet) for layer in recurrent)
