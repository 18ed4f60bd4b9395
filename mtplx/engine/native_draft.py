"""Greedy draft chains in one C call on the CPU fp32 path (mtplx/native/draft_step.c).

Why: on the CPU backend a draft step of a small MTP head is dispatch-bound. Measured on the
embedded models (2-core x86, fp32 + MKL): a draft step through the compiled MLX steps took ~0.25 ms
against a 4-layer trunk step's ~0.72 ms, while its arithmetic (one 256-wide layer and a 4,096-row
LM head, ~1.9M multiply-adds) is a fraction of that. A depth-3 round spent a third of its time
drafting. Drafts decide speed only: the trunk verifies every one, so the output is the same
whoever drafts (tests/test_native_draft.py checks MTP == AR with the chain here).

What runs here, per round: the head over the round's pending pairs (the keys and values of every
pair, the whole layer for the last), each draft's LM head (the draft vocabulary's rows when set, a
history-free rule's vector added) and argmax, and the head steps between drafts. It reads the
head's cache in place and half-precision copies of its matrices; the pairs' keys and values go back
to the head's cache through MLX (the caller appends `pending_kv`), the chain's own positions stay in
its scratch buffer. A batch's rows step together through the kernel (each product reads the head's
matrices once for all of them, and a row drafts the same bits as alone), in one call whose products
share their rows of W with the kernel's helper thread (the chain streams its weights back from
memory after each verify, and two cores stream them at about twice one's rate): in process, side by
side (bench/native_draft.py --rounds 10 --depth 2), 1.13x (tiny-dense) and 1.22x (tiny-hybrid)
decode alone and 1.06x four at once against the chain without it. Only where the process lends it a second core (`second_core`: not beside `mtplx
serve`'s threads for the embedded models, where it measured slower); elsewhere, and with
MTPLX_DRAFT_TEAM=off, a batch's rows go in two groups, one on a helper Python thread.
Sampled drafts, rules that read history, quantized or MoE heads and sharded models keep the MLX
chain. MTPLX_NATIVE_DRAFT=off turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from mtplx import native_build

log = logging.getLogger(__name__)

ENV = "MTPLX_NATIVE_DRAFT"
BUILD = native_build.Kernel("draft_step", libs=("-lpthread",), extra=("-mf16c",), features=("f16c",))  # half-precision weight loads
MAX_SLOTS = 64  # the kernel's scratch slots: pending pairs + drafts
TEAM = os.environ.get("MTPLX_DRAFT_TEAM", "on").lower() not in ("off", "0", "false")

# The chain pays where a head step is dispatch-bound: measured on the embedded models' heads (~0.9M
# multiply-adds a step in its matrices), where one core's loops beat MLX's ~40 dispatched ops. A
# bigger head's step is compute, which MLX spreads over MKL's threads: it keeps MLX's chain (not
# measured here, so not claimed).
MAX_HEAD_MACS = 4_000_000
# The LM head rows drafts are chosen from are copied to half precision; past this (a real
# vocabulary before a draft vocabulary is learned) that round drafts with MLX.
MAX_LM_COPY_BYTES = 64 << 20


def second_core() -> bool:
    """Whether the process lends this kind of work a second core now: where the small-row kernel is
    loaded, whether its helper thread is on. A serving process keeps that helper only for a model
    whose step is big enough (small_gemm.fit_helper): beside the HTTP loop and the client on two
    cores, the kernel's helper made tiny-dense's MTP decode through `mtplx serve` 0.84x as fast
    (bench/serve_ab.py --variable MTPLX_DRAFT_TEAM --values off on, 12 rounds: 1,315 -> 1,103 tok/s;
    tiny-hybrid 867 -> 830), where in process it made it 1.13-1.2x as fast."""
    from mtplx import fast_path  # loaded before MLX by whoever imported MLX first

    if fast_path.KERNEL is not None:
        return bool(ctypes.c_int.in_dll(fast_path.KERNEL, "mtplx_small_threads").value)
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)) >= 2


class _Head(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "rot_dims", "inter",
                                                  "vocab", "gated")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] \
        + [(name, ctypes.c_void_p) for name in ("embed", "lm_head", "lm_ids", "norm_e", "norm_h", "fc", "in_norm", "wq",
                                                "wk", "wv", "q_norm", "k_norm", "wo", "post_norm", "w_gate", "w_up",
                                                "w_down", "final_norm", "rope")] \
        + [("rope_rows", ctypes.c_int)]


class _Row(ctypes.Structure):
    """One chain of a call (the kernel's Row)."""
    _fields_ = [("hidden", ctypes.c_void_p), ("tokens", ctypes.c_void_p), ("pairs", ctypes.c_int),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("cap", ctypes.c_int), ("offset", ctypes.c_int),
                ("bias", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("scratch_floats", ctypes.c_long),
                ("out", ctypes.c_void_p), ("done", ctypes.c_int)]


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


class _Workspace:
    """One chain's scratch (its pairs' keys and values, logits, a step's vectors), inputs and drafts."""

    def __init__(self):
        self.scratch = np.zeros(0, dtype=np.float32)
        self.out = np.zeros(MAX_SLOTS, dtype=np.int32)
        self.hidden = self.ids = None

    def fit(self, floats: int) -> None:
        if self.scratch.size < floats:
            self.scratch = np.zeros(max(floats, 2 * self.scratch.size), dtype=np.float32)


class NativeDraft:
    """The C chain bound to one runner's head. Build with `for_runner`; only the engine thread calls it."""

    def __init__(self, lib: ctypes.CDLL, runner):
        self.lib, self.runner = lib, runner
        self.set_prefetch(native_build.switched_on(native_build.PREFETCH_ENV))
        lib.mtplx_draft_chains.restype = ctypes.c_int
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
        macs = sum(arrays[n].size for n in matrices)
        if macs > MAX_HEAD_MACS:
            raise ValueError(f"a head step of {macs / 1e6:.1f}M multiply-adds is compute-bound "
                             f"(the kernel pays up to {MAX_HEAD_MACS / 1e6:.0f}M)")
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
        self._rope = None  # (the rotary table's rows, their host view) the kernel reads
        self._biases: dict[int, tuple] = {}  # id of a rule's vector -> (it, its host copy)
        self._spaces: list[_Workspace] = []  # one per row of the last chains
        self._pool: ThreadPoolExecutor | None = None  # the helper that takes half of a batch's rows

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

    def _lm_head(self) -> bool:
        """Point the kernel at the rows drafts are chosen from (the draft vocabulary's when set);
        False when their copy would pass MAX_LM_COPY_BYTES."""
        runner = self.runner
        if self._lm_key is not None and self._lm_key[0] is runner.draft_ids:
            return True
        weight = runner._project_module.weight if runner.draft_ids is None else runner.draft_weight
        if weight.size * 2 > MAX_LM_COPY_BYTES:
            return False
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
        return True

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
        out = self.chain_rows([(hidden, tokens, keys, values, cache.offset, bias)], steps)
        return None if out is None else out[0]

    def chain_rows(self, rows: list[tuple], steps: int, helper: bool = True) -> list[list[int]] | None:
        """One chain per row of a batch, each (hidden, tokens, keys, values, offset, bias): as
        `chain` takes them, with the head's cache as host arrays (1, kv_heads, capacity, head_dim)
        whose first `offset` positions are the head's (a row's part of a batch's cache reads in
        place). The rows step together in one call, its products shared with the kernel's helper
        thread (`helper` False: all on this thread). None when the kernel refuses any row."""
        if not self._lm_head():
            return None
        ends = []
        for hidden, tokens, keys, values, offset, bias in rows:
            pairs = len(tokens)
            if pairs < 1 or pairs + steps > MAX_SLOTS or hidden.shape[1] != pairs \
                    or (bias is not None and bias.shape[0] != self.head.vocab) \
                    or (offset and (keys is None or keys.dtype != np.float32 or not keys.flags.c_contiguous
                                    or not values.flags.c_contiguous or offset > keys.shape[2])):
                return None
            ends.append(offset + pairs + steps)
        if max(ends) > self.table.rows.shape[0]:
            self.table.at(0, max(ends))  # grows the table to cover every chain's positions
        if self._rope is None or self._rope[0] is not self.table.rows:  # viewed again only once it grew
            self._rope = (self.table.rows, _view(self.table.rows))
            self.head.rope, self.head.rope_rows = self._rope[1].ctypes.data, self._rope[1].shape[0]
        mx.eval([r[0] for r in rows])
        while len(self._spaces) < len(rows):
            self._spaces.append(_Workspace())
        chains = (_Row * len(rows))()
        for row, (hidden, tokens, keys, values, offset, bias), end, space in zip(chains, rows, ends, self._spaces):
            space.fit(int(self.lib.mtplx_draft_scratch(ctypes.byref(self.head), end)))
            space.hidden = np.ascontiguousarray(np.array(hidden, copy=False)[0], dtype=np.float32)
            space.ids = np.array(tokens, dtype=np.int32)
            row.hidden, row.tokens, row.pairs = space.hidden.ctypes.data, space.ids.ctypes.data, len(tokens)
            if offset:
                row.keys, row.values, row.cap = keys.ctypes.data, values.ctypes.data, keys.shape[2]
            row.offset, row.bias = offset, self._bias_view(bias)
            row.scratch, row.scratch_floats, row.out = space.scratch.ctypes.data, space.scratch.size, space.out.ctypes.data
        if TEAM and helper and second_core():  # every row in one call, each product shared with the kernel's helper
            mine, theirs = self._run(chains, 0, len(rows), steps, share=True), 0
        else:
            # Two rows or more: half of them on a helper thread (ctypes lets go of the GIL; the MLX
            # stream is idle meanwhile), each half stepping its rows together.
            split = (len(rows) + 1) // 2 if helper else len(rows)
            later = None if split == len(rows) else self._helper().submit(self._run, chains, split, len(rows) - split, steps)
            mine = self._run(chains, 0, split, steps)
            theirs = later.result() if later is not None else 0  # waited for even when ours failed: it writes our buffers
        if mine != 0 or theirs != 0:
            return None
        done = [row.done for row in chains]
        if any(d != steps for d in done):
            log.warning("the native draft chain made %s of %d drafts; this round drafts with MLX", done, steps)
            return None
        return [space.out[:steps].tolist() for space in self._spaces[:len(rows)]]

    def _run(self, chains, start: int, n: int, steps: int, share: bool = False) -> int:
        """Rows start .. start + n - 1 of `chains`, stepping together (`share`: each product's rows
        of W split with the kernel's helper thread)."""
        first = ctypes.byref(chains, start * ctypes.sizeof(_Row))
        return self.lib.mtplx_draft_chains(ctypes.byref(self.head), first, n, steps, int(share))

    def _helper(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtplx-draft")
        return self._pool

    def _bias_view(self, bias: mx.array | None) -> int | None:
        """The address of a rule's vector on the host (made once per request: logit_mask.py)."""
        if bias is None:
            return None
        if id(bias) not in self._biases:
            if len(self._biases) >= 64:
                self._biases.clear()
            self._biases[id(bias)] = (bias, np.ascontiguousarray(_view(bias.astype(mx.float32))))
        return self._biases[id(bias)][1].ctypes.data

    def set_prefetch(self, on: bool) -> None:
        """Fetch the next rows of W while a block computes (True, the default) or not, for
        side-by-side runs (bench/small_gemm.py --compare prefetch). The same bits either way."""
        ctypes.c_int.in_dll(self.lib, "mtplx_draft_prefetch").value = 1 if on else 0

    def pending_kv(self, pairs: int, row: int = 0) -> tuple[mx.array, mx.array]:
        """The keys and values of the last chain's (of `row`'s) pending pairs, (1, kv_heads, pairs,
        head_dim) each."""
        kvh, d = self.head.kv_heads, self.head.head_dim
        slots = self._spaces[row].scratch[:2 * kvh * MAX_SLOTS * d].reshape(2, kvh, MAX_SLOTS, d)
        return mx.array(slots[0, None, :, :pairs]), mx.array(slots[1, None, :, :pairs])
