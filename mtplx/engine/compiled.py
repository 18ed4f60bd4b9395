"""Compiled forwards for short steps: a decode step, a verify, a draft (1 to STEP_TOKENS tokens).

On the CPU backend a 4-layer model's decode step is ~650 MLX ops (RMSNorm, RoPE and attention
have no CPU kernels and run as op graphs) and each costs microseconds of dispatch: that, not
arithmetic, is most of a small step. mx.compile fuses each layer's elementwise runs into a few
kernels. What cannot compile is what grows every step (the KV cache write and the attention over
it), so an attention layer is two compiled halves around them; a GatedDeltaNet layer's state has a
fixed shape, so it compiles whole, recording per-position states when the verify captures.

Knows mlx-lm's qwen3 and qwen3_5 (Qwen3-Next layer) classes, which the MTP head reuses; for any
other model `build` returns None and the runner keeps mlx-lm's forward. Prefill chunks never come
here: their shapes change chunk to chunk, and compute, not dispatch, dominates them. Each half does
the same operations in the same order as mlx-lm's module; the outputs (hidden states, logits, MTP
head states, caches) were bit-identical to mlx-lm's forward on both CPU paths (fp32 + MKL and bf16
reference), tested in tests/test_compiled_steps.py.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3 import Attention as Qwen3Attention
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from mtplx.engine import fast_silu, fused_projections, gdn_step, preemption, rotary_table
from mtplx.engine.batch_cache import RaggedKVCache

STEP_TOKENS = 16  # longer inputs (prefill chunks) run mlx-lm's forward
# Hand each layer's output to the device as soon as it is built (mx.async_eval), so the stream
# thread computes layer i while Python builds layer i+1. MLX's eval on the CPU keeps at most ~100
# ops (10 scheduler tasks of 10) in flight and blocks the caller until the rest are dispatched, so
# a step built whole and then evaluated pays its graph building (~0.2 ms a layer here) and its
# compute one after the other; an async_eval of a whole draft chain blocks the same way. Measured
# with bench/layer_pipeline.py. MTPLX_LAYER_PIPELINE=off builds each step whole, as before.
PIPELINE = os.environ.get("MTPLX_LAYER_PIPELINE", "on").lower() not in ("off", "0", "false")


class AttentionStep:
    """One full-attention decoder layer: compiled (norm, projections, RoPE) -> cache write and
    attention -> compiled (output projection, residual, MLP). `enter`/`leave` wrap the layer (the
    MTP head's input fusion and final norm) inside the compiled halves."""

    def __init__(self, layer, enter=None, leave=None):
        attn = layer.self_attn
        self.scale = attn.scale
        gated = isinstance(attn, Qwen3NextAttention)
        heads = attn.num_attention_heads if gated else attn.n_heads
        kv_heads = attn.num_key_value_heads if gated else attn.n_kv_heads
        # RoPE's angles from a table (rotary_table.py), and the query and key norms as one norm
        # over both: the same values as separate norms and nn.RoPE, ~a dozen fewer ops a layer.
        self.table = rotary_table.for_rope(attn.rope)
        joint = _joint_norm_weight(attn.q_norm, attn.k_norm, heads, kv_heads)
        qkv = fused_projections.fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp = fused_projections.swiglu_mlp(layer.mlp) or layer.mlp

        def before(x, rope, *extra):
            if enter is not None:
                x = enter(x, *extra)
            B, L, _ = x.shape
            h = layer.input_layernorm(x)
            q, k, v = qkv(h) if qkv is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            if gated:
                q, gate = mx.split(q.reshape(B, L, heads, -1), 2, axis=-1)
                gate = gate.reshape(B, L, -1)
            else:
                q, gate = q.reshape(B, L, heads, -1), None
            k = k.reshape(B, L, kv_heads, -1)
            v = v.reshape(B, L, kv_heads, -1).transpose(0, 2, 1, 3)
            if joint is not None:
                qk = (mx.fast.rms_norm(mx.concatenate([q, k], axis=2), None, attn.q_norm.eps) * joint).transpose(0, 2, 1, 3)
            else:
                qk = mx.concatenate([attn.q_norm(q), attn.k_norm(k)], axis=2).transpose(0, 2, 1, 3)
            # One RoPE over queries and keys together: the same per-element rotation, half the
            # op graph.
            qk = self.table.rotate(qk, rope) if self.table is not None else attn.rope(qk, offset=rope)
            out = (x, qk[:, :heads], qk[:, heads:], v)
            return out + ((gate,) if gated else ())

        def after(x, o, *gate):
            B, _, L, _ = o.shape
            o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
            h = x + attn.o_proj(o * mx.sigmoid(gate[0]) if gated else o)
            out = h + mlp(layer.post_attention_layernorm(h))
            return leave(out) if leave is not None else out

        self.before, self.after = mx.compile(before), mx.compile(after)

    def __call__(self, x, cache: KVCache, *extra, last: bool | mx.array = False):
        """`last`: every position's keys and values go to the cache, but only the last position
        (or each row's, given as a (B,) index array) attends and runs the rest of the layer, the
        output being (B, 1, H): what a head step over several pending pairs needs, since only the
        last pair's output starts a draft chain."""
        mask = create_attention_mask(x, cache)
        if self.table is None:
            rope = mx.array(cache.offset)
        elif isinstance(cache, RaggedKVCache):
            rope = self.table.at(cache.offset, x.shape[1], cache.lengths)
        else:
            rope = self.table.at(cache.offset, x.shape[1])
        x, q, k, v, *gate = self.before(x, rope, *extra)
        keys, values = cache.update_and_fetch(k, v)
        if isinstance(last, mx.array):  # each row's own last position (a batch, right-padded)
            at = last[:, None, None]
            q, x = mx.take_along_axis(q, at[..., None], axis=2), mx.take_along_axis(x, at, axis=1)
            gate = [mx.take_along_axis(g, at, axis=1) for g in gate]
            mask = mx.take_along_axis(mask, at[..., None], axis=2)  # a ragged cache's mask is an array
        elif last and q.shape[2] > 1:
            # The last query sees every key: a causal mask's last row is all open.
            q, x, gate = q[:, :, -1:], x[:, -1:], [g[:, -1:] for g in gate]
            mask = mask[..., -1:, :] if isinstance(mask, mx.array) else None
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.after(x, o, *gate)


def _joint_norm_weight(q_norm, k_norm, heads: int, kv_heads: int) -> mx.array | None:
    """Per-head weights for normalising queries and keys in one RMSNorm (None: keep two)."""
    if type(q_norm) is not nn.RMSNorm or type(k_norm) is not nn.RMSNorm or q_norm.eps != k_norm.eps:
        return None
    dim = q_norm.weight.shape[-1]
    weight = mx.concatenate([mx.broadcast_to(q_norm.weight, (heads, dim)), mx.broadcast_to(k_norm.weight, (kv_heads, dim))])
    mx.eval(weight)
    return weight


class RecurrentStep:
    """One GatedDeltaNet decoder layer, compiled whole: the same steps as gdn_capture's capturing
    forward (gdn_step's recurrence), with the per-position states when capturing."""

    def __init__(self, layer, leave=None):
        net = layer.linear_attn
        keep = net.conv_kernel_size - 1
        projections = fused_projections.fuse([net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a])
        mlp = fused_projections.swiglu_mlp(layer.mlp) or layer.mlp
        activation = fast_silu.silu if net.vector_silu else nn.silu  # as the layer's own forward (gdn_capture)

        def run(x, conv_state, state, capture):
            B, S, _ = x.shape
            inputs = layer.input_layernorm(x)
            qkv, z, b, a = projections(inputs) if projections is not None else (
                net.in_proj_qkv(inputs), net.in_proj_z(inputs), net.in_proj_b(inputs), net.in_proj_a(inputs))
            z = z.reshape(B, S, net.num_v_heads, net.head_v_dim)
            conv_input = mx.concatenate([conv_state, qkv], axis=1)
            conv_out = activation(net.conv1d(conv_input))
            q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(
                mx.split(conv_out, [net.key_dim, 2 * net.key_dim], -1),
                [net.num_k_heads, net.num_k_heads, net.num_v_heads], [net.head_k_dim, net.head_k_dim, net.head_v_dim])]
            q, k = gated_delta.normalize_qk(q, k, inv_scale=net.head_k_dim**-0.5, eps=1e-6)
            beta = mx.sigmoid(b)
            g = gated_delta.compute_g(net.A_log, a, net.dt_bias)
            if (repeat := net.num_v_heads // net.num_k_heads) > 1:
                q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
            ys, positions = [], []
            # gdn_step's recurrence, position by position, the state carrying the position axis
            # (size 1) so each step takes its split inputs without per-step view ops.
            steps = zip(*(mx.split(a, S, axis=1) if S > 1 else [a] for a in (q, k, v, g, beta)))
            state = state[:, None]
            for t, (qt, kt, vt, gt, bt) in enumerate(steps):
                y, state = gdn_step.step(qt, kt, vt, gt, bt, state)
                ys.append(y)
                if capture:
                    positions += [conv_input[:, t + 1 : t + 1 + keep, :], state[:, 0]]
            state = state[:, 0]
            r = net.out_proj(net.norm(mx.concatenate(ys, axis=1) if S > 1 else ys[0], z).reshape(B, S, -1))
            h = x + r
            out = h + mlp(layer.post_attention_layernorm(h))
            out = leave(out) if leave is not None else out
            return (out, mx.contiguous(conv_input[:, -keep:, :]), state, *positions)

        self.keep, self.net = keep, net
        self.plain = mx.compile(lambda x, c, s: run(x, c, s, False))
        self.capturing = mx.compile(lambda x, c, s: run(x, c, s, True))

    def __call__(self, x, cache: ArraysCache):
        B, S, _ = x.shape
        net = self.net
        conv = cache[0] if cache[0] is not None else mx.zeros((B, self.keep, net.conv_dim), dtype=x.dtype)
        state = cache[1] if cache[1] is not None else mx.zeros(
            (B, net.num_v_heads, net.head_v_dim, net.head_k_dim), dtype=mx.float32)
        capture = getattr(cache, "capture", False)
        out, cache[0], cache[1], *positions = (self.capturing if capture else self.plain)(x, conv, state)
        cache.advance(S)
        if capture:
            cache.positions = list(zip(positions[::2], positions[1::2]))
        return out


def _rows_fit(rows: int, cache: list) -> bool:
    if rows == 1:
        return all(type(c) in (KVCache, ArraysCache) for c in cache)
    return all(type(c) in (RaggedKVCache, ArraysCache) for c in cache)


def _step(layer, leave=None):
    """The compiled step of one decoder layer (`leave`: applied to its output inside), or None."""
    if hasattr(layer, "linear_attn"):
        # Only the GatedDeltaNet gdn_capture knows: its capture contract is the one kept here.
        from mtplx.engine.gdn_capture import CapturingGatedDeltaNet

        return RecurrentStep(layer, leave) if isinstance(layer.linear_attn, CapturingGatedDeltaNet) else None
    attn = getattr(layer, "self_attn", None)
    if isinstance(attn, (Qwen3Attention, Qwen3NextAttention)) and type(attn.rope) is nn.RoPE:
        return AttentionStep(layer, leave=leave)
    return None


class StepForward:
    """The trunk's hidden states for a short input, through compiled layer steps."""

    def __init__(self, inner, steps: list):
        self.inner, self.steps = inner, steps

    def usable(self, tokens: mx.array, cache: list) -> bool:
        # Several rows only as a scheduler batch (batch_cache.RaggedKVCache: per-row offsets and mask).
        return (tokens.shape[1] <= STEP_TOKENS and _rows_fit(tokens.shape[0], cache)
                and all(c.lengths is None and not getattr(c, "stops", ()) for c in cache if type(c) is ArraysCache))

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        x = self.inner.embed_tokens(tokens)
        for step, c in zip(self.steps, cache):
            preemption.between_layers(x)  # a no-op outside a background prefill
            x = step(x, c)
            if PIPELINE:
                mx.async_eval(x)  # computes while the next layer is built (see PIPELINE)
        return x  # the last step applied the final norm


class HeadStep:
    """The MTP head's step (MTPHead's input fusion, its one attention layer, its final norm)."""

    def __init__(self, head, pipeline: bool = True):
        self.pipeline = pipeline  # off on sharded ranks: an early eval could run a collective out of step

        def enter(hidden, embeds):
            return head.fc(mx.concatenate([head.pre_fc_norm_embedding(embeds), head.pre_fc_norm_hidden(hidden)], axis=-1))

        # The compiled `before` takes the trunk hidden as x, the embeddings riding along.
        self.step = AttentionStep(head.layers[0], enter=enter, leave=head.norm)

    def usable(self, embeds: mx.array, cache) -> bool:
        return type(cache) in (KVCache, RaggedKVCache) and _rows_fit(embeds.shape[0], [cache]) and embeds.shape[1] <= STEP_TOKENS

    def __call__(self, hidden: mx.array, embeds: mx.array, cache: KVCache, last: bool | mx.array = False) -> mx.array:
        out = self.step(hidden, cache, embeds, last=last)
        if PIPELINE and self.pipeline:
            mx.async_eval(out)  # a draft chain's next step is built while this one computes
        return out


def build(inner) -> StepForward | None:
    """Compiled steps for the trunk, or None when one of its layers is of a kind not known here."""
    if not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return None
    layers = getattr(inner, "layers", [])
    steps = [_step(layer, leave=inner.norm if i == len(layers) - 1 else None) for i, layer in enumerate(layers)]
    if not steps or any(s is None for s in steps):
        return None
    return StepForward(inner, steps)


def build_head(head, pipeline: bool = True) -> HeadStep | None:
    if head is None or head.array_mask or _step(head.layers[0]) is None or hasattr(head.layers[0], "linear_attn"):
        return None
    return HeadStep(head, pipeline)
