"""Greedy draft chains in one C call on the CPU fp32 path (mtplx/native/draft_step.c).

Why: on the CPU backend a draft step of a small MTP head is dispatch-bound. Measured on the
embedded models (2-core x86, fp32 + MKL): a draft step through the compiled MLX steps took ~0.25 ms
against a 4-layer trunk step's ~0.72 ms, while its arithmetic (one 256-wide layer and a 4,096-row
LM head, ~1.9M multiply-adds) is a fraction of that. A depth-3 round spent a third of its time
drafting. Drafts decide speed only: the trunk verifies every one, so the output is the same
whoever drafts (tests/test_native_draft.py checks MTP == AR with the chain here).

What stays in MLX: the chain's first head step over the pending pairs (it writes their keys and
values to the head's cache, which the bank and rollback own). What runs here: each draft's LM head
and argmax, and the head steps between drafts, reading the head's weights and cache in place and
keeping the chain's own keys and values in a scratch buffer (the engine drops a chain's cache
entries after the verify anyway). Greedy drafts only; sampled drafts, rules on the logits, batches,
quantized or MoE heads and sharded models keep the MLX chain. MTPLX_NATIVE_DRAFT=off turns it off.
"""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from mtplx import native_build

log = logging.getLogger(__name__)

ENV = "MTPLX_NATIVE_DRAFT"
BUILD = native_build.Kernel("draft_step", extra=("-mf16c",), features=("f16c",))  # half-precision weight loads
MAX_SLOTS = 64  # the kernel's scratch slots: pending pairs + drafts
# The half-precision copies of the head's matrices and LM head cost memory; past this a head keeps
# the MLX chain (a large head's step is compute, not dispatch, anyway). The embedded models: ~4 MB.
MAX_COPY_BYTES = 256 << 20


class _Head(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "rot_dims", "inter",
                                                  "vocab", "gated")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] \
        + [(name, ctypes.c_void_p) for name in ("embed", "lm_head", "lm_ids", "norm_e", "norm_h", "fc", "in_norm", "wq",
                                                "wk", "wv", "q_norm", "k_norm", "wo", "post_norm", "w_gate", "w_up",
                                                "w_down", "final_norm", "rope")] \
        + [("rope_rows", ctypes.c_int), ("bias", ctypes.c_void_p)]


def _view(array: mx.array) -> np.ndarray:
    """A zero-copy fp32 view of an evaluated MLX array (row-major), or ValueError."""
    mx.eval(array)
    view = np.array(array, copy=False)
    if view.dtype != np.float32 or not view.flags.c_contiguous:
        raise ValueError("not a contiguous fp32 array")
    return view


def _plain_linear(module) -> mx.array:
    if type(module) is not nn.Linear or "bias" in module:
        raise ValueError(f"{type(module).__name__} with bias or quantized weights")
    return module.weight


class NativeDraft:
    """The C chain bound to one runner's head. Build with `for_runner`; only the engine thread calls it."""

    def __init__(self, lib: ctypes.CDLL, runner):
        self.lib, self.runner = lib, runner
        lib.mtplx_draft_chain.restype = ctypes.c_int
        lib.mtplx_draft_scratch.restype = ctypes.c_long
        head, layer = runner.mtp, runner.mtp.layers[0]
        attn = layer.self_attn
        gated = hasattr(attn, "num_attention_heads")
        heads = attn.num_attention_heads if gated else attn.n_heads
        kv_heads = attn.num_key_value_heads if gated else attn.n_kv_heads
        norms = [head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, layer.input_layernorm, attn.q_norm,
                 attn.k_norm, layer.post_attention_layernorm, head.norm]
        if any(type(n) is not nn.RMSNorm for n in norms) or len({n.eps for n in norms}) != 1:
            raise ValueError("the head's norms are not plain RMSNorms with one epsilon")
        mlp = layer.mlp
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"the head's MLP ({type(mlp).__name__}) is not a SwiGLU MLP")
        table = runner._head_steps.step.table if runner._head_steps is not None else None
        if table is None or attn.rope.traditional:
            raise ValueError("the head's RoPE has no rotary table")
        self.table = table
        arrays = {"embed": runner.embedding.weight, "norm_e": head.pre_fc_norm_embedding.weight,
                  "norm_h": head.pre_fc_norm_hidden.weight, "fc": _plain_linear(head.fc),
                  "in_norm": layer.input_layernorm.weight, "wq": _plain_linear(attn.q_proj),
                  "wk": _plain_linear(attn.k_proj), "wv": _plain_linear(attn.v_proj), "q_norm": attn.q_norm.weight,
                  "k_norm": attn.k_norm.weight, "wo": _plain_linear(attn.o_proj),
                  "post_norm": layer.post_attention_layernorm.weight, "w_gate": _plain_linear(mlp.gate_proj),
                  "w_up": _plain_linear(mlp.up_proj), "w_down": _plain_linear(mlp.down_proj),
                  "final_norm": head.norm.weight}
        if type(runner.embedding) is not nn.Embedding:
            raise ValueError("a quantized token embedding")
        matrices = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        copy = sum(arrays[n].size for n in matrices) * 2 + runner._project_module.weight.size * 2
        if copy > MAX_COPY_BYTES:
            raise ValueError(f"its half-precision copy would take {copy >> 20} MB (at most {MAX_COPY_BYTES >> 20})")
        # Kept here: the kernel reads the vectors in place and the matrices' half-precision copies.
        self._views = {name: _view(a).astype(np.float16) if name in matrices else _view(a) for name, a in arrays.items()}
        hidden = head.fc.weight.shape[0]
        head_dim = attn.k_norm.weight.shape[-1]
        inter = mlp.gate_proj.weight.shape[0]
        if hidden % 8 or head_dim % 8 or inter % 8 or heads % kv_heads or heads // kv_heads > 64:
            raise ValueError(f"widths the kernel does not take (hidden {hidden}, head_dim {head_dim}, MLP {inter}, "
                             f"heads {heads} / {kv_heads})")
        self.head = _Head(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rot_dims=attn.rope.dims,
                          inter=inter, vocab=0, gated=int(gated), eps=norms[0].eps,
                          scale=attn.scale, **{n: v.ctypes.data for n, v in self._views.items()})
        self._lm_key = None
        self._bias_key = None
        self._scratch = np.zeros(0, dtype=np.float32)
        self._out = np.zeros(MAX_SLOTS, dtype=np.int32)

    @classmethod
    def for_runner(cls, runner) -> tuple[NativeDraft | None, str | None]:
        """(the chain, None) where the head can draft here, or (None, why not)."""
        if not native_build.switched_on(ENV):
            return None, f"{ENV}=off"
        if runner.mtp is None or runner._head_steps is None or runner.sharded or runner.agree is not None:
            return None, "no MTP head on compiled CPU steps"
        if runner._project_module is None or type(runner._project_module) not in (nn.Linear, nn.Embedding) \
                or "bias" in runner._project_module:
            return None, "the LM head is quantized or has a bias"
        lib, why = BUILD.load()
        if lib is None:
            return None, why
        try:
            return cls(lib, runner), None
        except (ValueError, AttributeError, TypeError) as exc:
            return None, f"the head's layout is not one the kernel knows ({exc})"

    def _lm_head(self) -> None:
        """Point the kernel at the rows drafts are chosen from (the draft vocabulary's when set)."""
        runner = self.runner
        if self._lm_key is not None and self._lm_key[0] is runner.draft_ids:
            return
        weight = runner._project_module.weight if runner.draft_ids is None else runner.draft_weight
        self._views["lm_head"] = _view(weight).astype(np.float16)
        self.head.lm_head = self._views["lm_head"].ctypes.data
        self.head.vocab = weight.shape[0]
        if runner.draft_ids is None:
            self._views.pop("lm_ids", None)
            self.head.lm_ids = None
        else:
            ids = np.array(runner.draft_ids, dtype=np.int32)
            self._views["lm_ids"] = ids
            self.head.lm_ids = ids.ctypes.data
        self._lm_key = (runner.draft_ids,)

    def usable(self, cache, pairs: int, steps: int) -> bool:
        return type(cache) is KVCache and pairs >= 1 and pairs + steps <= MAX_SLOTS

    def chain(self, hidden: mx.array, tokens: list[int], cache: KVCache, steps: int,
              bias: mx.array | None = None) -> list[int] | None:
        """`steps` greedy drafts after the pending pairs (hidden (1, P, H) at t, tokens[t] the
        token after it): the head over the pairs, then its argmax and a head step per further
        draft. `bias`: a history-free rule's vector over the rows drafts are chosen from (added to
        their logits). `cache` (the head's) holds the positions before the pairs and is not
        changed. None when the kernel refuses (the caller drafts with MLX)."""
        if not self.usable(cache, len(tokens), steps):
            return None
        if cache.offset:
            mx.eval(cache.keys, cache.values)
            keys, values = np.array(cache.keys, copy=False), np.array(cache.values, copy=False)
        else:
            keys = values = None
        return self.chain_over(hidden, tokens, keys, values, cache.offset, steps, bias)

    def chain_over(self, hidden: mx.array, tokens: list[int], keys: np.ndarray | None, values: np.ndarray | None,
                   offset: int, steps: int, bias: mx.array | None = None) -> list[int] | None:
        """`chain` over a cache given as host arrays (1, kv_heads, capacity, head_dim) whose first
        `offset` positions are the head's: one row of a batch's cache reads in place too."""
        pairs = len(tokens)
        if pairs < 1 or pairs + steps > MAX_SLOTS or hidden.shape[1] != pairs:
            return None
        self._lm_head()
        if bias is not None and bias.shape[0] != self.head.vocab:
            return None
        self._bias(bias)
        end = offset + pairs + steps
        self.table.at(0, end)  # grows the table to cover the chain's positions
        rope = _view(self.table.rows)
        self.head.rope, self.head.rope_rows = rope.ctypes.data, rope.shape[0]
        if offset:
            if keys.dtype != np.float32 or not (keys.flags.c_contiguous and values.flags.c_contiguous):
                keys, values = np.ascontiguousarray(keys, np.float32), np.ascontiguousarray(values, np.float32)
            cap, kp, vp = keys.shape[2], keys.ctypes.data, values.ctypes.data
        else:
            cap, kp, vp = 0, None, None
        need = int(self.lib.mtplx_draft_scratch(ctypes.byref(self.head), end))
        if self._scratch.size < need:
            self._scratch = np.zeros(max(need, 2 * self._scratch.size), dtype=np.float32)
        mx.eval(hidden)
        rows = np.ascontiguousarray(np.array(hidden, copy=False)[0], dtype=np.float32)
        ids = np.array(tokens, dtype=np.int32)
        done = self.lib.mtplx_draft_chain(ctypes.byref(self.head), ctypes.c_void_p(rows.ctypes.data),
                                          ctypes.c_void_p(ids.ctypes.data), ctypes.c_int(pairs), ctypes.c_void_p(kp),
                                          ctypes.c_void_p(vp), ctypes.c_int(cap), ctypes.c_int(offset),
                                          ctypes.c_int(steps), ctypes.c_void_p(self._scratch.ctypes.data),
                                          ctypes.c_long(self._scratch.size), ctypes.c_void_p(self._out.ctypes.data))
        if done != steps:
            log.warning("the native draft chain made %d of %d drafts; this round drafts with MLX", done, steps)
            return None
        return self._out[:steps].tolist()

    def _bias(self, bias: mx.array | None) -> None:
        if bias is None:
            self.head.bias = None
            return
        if self._bias_key is not bias:  # a rule's vector is made once per request (logit_mask.py)
            self._views["bias"] = np.ascontiguousarray(_view(bias.astype(mx.float32)))
            self._bias_key = bias
        self.head.bias = self._views["bias"].ctypes.data

    def pending_kv(self, pairs: int) -> tuple[mx.array, mx.array]:
        """The last chain's keys and values of its pending pairs, (1, kv_heads, pairs, head_dim) each."""
        kvh, d = self.head.kv_heads, self.head.head_dim
        slots = self._scratch[:2 * kvh * MAX_SLOTS * d].reshape(2, kvh, MAX_SLOTS, d)
        return mx.array(slots[0, None, :, :pairs]), mx.array(slots[1, None, :, :pairs])
