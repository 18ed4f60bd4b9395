"""Forward passes over a loaded checkpoint: trunk hidden states, logits, the MTP head.

The runner knows arrays and caches, never requests or events. Only the engine thread calls it.
"""

from __future__ import annotations

import contextlib
import copy
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from mtplx.engine import compiled, gdn_capture, preemption
from mtplx.engine.checkpoint import Checkpoint, text_embedding, text_inner, text_outer
from mtplx.engine.compute import blas_threads
from mtplx.errors import ModelLoadError
from mtplx.state import cache_layers


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.mtp = checkpoint.mtp
        outer = text_outer(self.model)
        self.inner, self.embedding = text_inner(self.model), text_embedding(self.model)
        if self.embedding is None:
            raise ModelLoadError(f"{checkpoint.path}: mtplx cannot run model_type {checkpoint.model_type!r}: its mlx-lm "
                                 "class has no `.model` text model with a token embedding to compute hidden states")
        tied = getattr(getattr(outer, "args", None), "tie_word_embeddings", False) or getattr(outer, "tie_word_embeddings", False) \
            or not hasattr(outer, "lm_head")
        self._project = self.embedding.as_linear if tied else outer.lm_head
        if not tied and getattr(outer, "sharding_group", None) is not None:  # a vocab-sharded head (tp)
            from mlx_lm.models.base import gather_last_axis

            self._project = lambda h: gather_last_axis(outer.lm_head(h), outer.sharding_group)
        self._head_transform = head_transform(outer)
        # Recurrent state of any kind (GatedDeltaNet, Mamba, LFM2's short convolutions), read from
        # the cache the model itself makes: such state exists only where it was captured.
        cache = self.new_trunk_cache()
        self.has_recurrent = cache_layers.has_recurrent(cache)
        self._has_window = cache_layers.has_window(cache)
        # GatedDeltaNet prefill in matrix form where rows are not bitwise anyway (CPU fp32 on MKL):
        # it rounds differently from the step function (gdn_prefill.py). MTPLX_GDN_CHUNKED=off to compare.
        chunked = (str(checkpoint.extras.get("compute")).startswith("cpu fp32 + mkl")
                   and os.environ.get("MTPLX_GDN_CHUNKED", "on").lower() not in ("off", "0", "false"))
        # Only GatedDeltaNet keeps its state at positions inside a forward (gdn_capture); any other
        # recurrent layer has a state at a forward's end alone.
        gdn = sum(hasattr(layer, "linear_attn") for layer in self.model.layers)
        recurrent = sum(isinstance(c, ArraysCache) for c in cache_layers.leaves(cache))
        vector_silu = " + vector silu" in str(checkpoint.extras.get("compute"))  # compute.prepare installed it
        self.can_capture = (gdn_capture.install(self.model, chunked, vector_silu) and gdn == recurrent) if self.has_recurrent else True
        # Short steps (decode, verify, draft) through compiled layers where the family is known;
        # on the CPU backend only, where per-op dispatch is what such a step costs.
        on_cpu = mx.default_device() == mx.cpu
        # A sharded trunk (mtplx/distributed) keeps mlx-lm's forward: its layers hold the collectives.
        self.sharded = bool(checkpoint.extras.get("layout"))
        # Pipeline ranks run different graphs: rank 0's `recv` does not depend on its input tokens,
        # so collectives still pending in those tokens (the drafts chained from rank 0's logits) or
        # in another lazy forward could run after it on one rank and before it on another (seen: a
        # batched verify deadlocked). So under pp a forward's input is evaluated first and the
        # forward itself at once.
        self._eager = str(checkpoint.extras.get("layout") or "").startswith("pp")
        self._steps = compiled.build(self.inner) if on_cpu and not self.sharded else None
        # Background prefills step aside between layers for an arriving request (preemption.py);
        # a sharded trunk's ranks must run every forward whole, in lockstep.
        if not self.sharded:
            preemption.install(getattr(self.inner, "layers", []))
        self.agree = None  # set on sharded ranks: every rank takes rank 0's logits (distributed/lockstep.py)
        self._head_steps = compiled.build_head(self.mtp, pipeline=not self.sharded) if on_cpu else None
        # The LM head's rows drafts are projected onto (draft_vocab.py); None: all of them.
        self._project_module = self.embedding if tied else getattr(outer, "lm_head", None)
        self.vocab_rows = self._project_module.weight.shape[0] if self._project_module is not None else 0
        self.draft_ids: mx.array | None = None
        self.draft_weight: mx.array | None = None
        self._draft_project = None
        self._native_draft, self.native_draft_reason = False, None  # False: not yet asked (native_draft())

    def native_draft(self):
        """The C draft chain for this head (engine/native_draft.py), or None where it cannot run;
        built at the first call (the engine's load), the reason kept in `native_draft_reason`."""
        if self._native_draft is False:
            from mtplx.engine.native_draft import NativeDraft

            try:
                self._native_draft, self.native_draft_reason = NativeDraft.for_runner(self)
            except Exception as exc:  # a kernel that fails to load costs speed, never serving
                self._native_draft, self.native_draft_reason = None, f"{type(exc).__name__}: {exc}"
        return self._native_draft

    def draft_chain(self) -> str:
        """Who drafts greedy rounds, for /health: 'c kernel', or 'mlx' and why not the kernel."""
        if self._native_draft:
            return "c kernel"
        return "mlx" + (f" ({self.native_draft_reason})" if self.native_draft_reason else "")

    def step_macs(self) -> int:
        """Multiply-adds of one token through the trunk's matmuls and the LM head (a quantized
        weight counts its unpacked size; a mixture of experts counts every expert)."""
        trunk = _macs(self.inner)  # holds the embedding table: the LM head when tied, else a lookup
        if self._project_module is self.embedding:
            return trunk
        head = _macs(self._project_module) if self._project_module is not None else 0
        return trunk - _macs(self.embedding) + head

    def lm_head_share(self) -> float:
        """The LM head's share of a draft step's multiply-adds (head layer + LM head) at one
        position, from parameter counts (a quantized weight counts its unpacked size)."""
        if self.mtp is None or self._project_module is None:
            return 0.0

        head = _macs(self.mtp.fc) + _macs(self.mtp.layers[0])
        lm = _macs(self._project_module)
        return lm / (lm + head) if lm + head else 0.0

    def use_draft_ids(self, ids: list[int] | None) -> bool:
        """Project drafts onto these token ids from now on (None: the whole vocabulary). A
        vocab-sharded or unknown LM head keeps the whole vocabulary; returns whether the set is used."""
        module = self._project_module
        if not ids or module is None or self.sharded or self.agree is not None \
                or not isinstance(module, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)):
            self.draft_ids, self._draft_project, self.draft_weight = None, None, None
            return False
        rows = mx.array(ids, dtype=mx.uint32)
        part = copy.copy(module)  # the same layer over fewer output rows (quantized rows slice alike)
        for name in ("weight", "scales", "biases", "bias"):
            if name in module:
                part[name] = module[name][rows]
        mx.eval(part.parameters())
        self.draft_ids = rows
        self.draft_weight = part["weight"]  # the set's rows (engine/native_draft.py reads them)
        self._draft_project = part.as_linear if hasattr(part, "as_linear") else part
        return True

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits a draft is chosen from: over `draft_ids` when set (map an index back with
        `draft_token`), else the whole vocabulary, as `logits`."""
        if self._draft_project is None:
            return self.logits(hidden)
        return self._head_transform(self._draft_project(hidden)).astype(mx.float32)

    def draft_token(self, index: mx.array) -> mx.array:
        """The token id of a `draft_logits` index (lazy, any shape)."""
        return index if self.draft_ids is None else self.draft_ids[index]

    # -- caches -----------------------------------------------------------------------------
    @property
    def has_window(self) -> bool:
        """Whether the trunk has sliding-window layers (Gemma 2/3, gpt-oss): their state past the
        window exists only where a prefill took a checkpoint, as recurrent state does."""
        return self._has_window

    def new_trunk_cache(self) -> list:
        return make_prompt_cache(self.model)

    def new_mtp_cache(self) -> KVCache | None:
        return KVCache() if self.mtp is not None else None

    # -- forwards ---------------------------------------------------------------------------
    def hidden(self, tokens: list[int] | mx.array, cache: list) -> mx.array:
        """Post-norm hidden states (1, T, H) for `tokens`, appended to `cache`. `tokens` may be a
        lazy int array (T,), so drafts chain into a verify without a round trip to the host."""
        ids = _batch(tokens)
        if self._steps is not None and self._steps.usable(ids, cache):
            return self._steps(ids, cache)
        if self._eager:
            mx.eval(ids)
        out = self.inner(ids, cache=cache)
        if self._eager:
            mx.eval(out, [c.state for c in cache])
        return out

    def logits(self, hidden: mx.array) -> mx.array:
        logits = self._head_transform(self._project(hidden)).astype(mx.float32)
        return self.agree(logits) if self.agree is not None else logits

    def embed(self, tokens: list[int] | mx.array) -> mx.array:
        return self.embedding(_batch(tokens))

    def draft_hidden(self, hidden: mx.array, next_tokens: list[int] | mx.array, mtp_cache: KVCache,
                     last: bool | mx.array = False) -> mx.array:
        """MTP head over (hidden[t], token[t+1]) pairs; returns its hidden states (B, T, H). With
        `last` only the last pair's (True) or each row's pair at the given index ((B,) array) is
        returned, (B, 1, H): the others are stored in the cache, their outputs never computed."""
        embeds = self.embed(next_tokens)
        if self._head_steps is not None and self._head_steps.usable(embeds, mtp_cache):
            return self._head_steps(hidden, embeds, mtp_cache, last=last)
        out = self.mtp(hidden, embeds, mtp_cache)
        if isinstance(last, mx.array):
            return mx.take_along_axis(out, last[:, None, None], axis=1)
        return out[:, -1:, :] if last else out

    def extend_head(self, hidden: mx.array, next_tokens: list[int] | mx.array, mtp_cache: KVCache) -> tuple:
        """The MTP head's cache over (hidden[t], token[t+1]) pairs whose outputs nobody reads (a
        prompt's): keys and values only, as a full `draft_hidden` would leave them. Returns the
        appended keys and values (lazy)."""
        return self.mtp.extend(hidden, self.embed(next_tokens), mtp_cache)

    def step_logits(self, tokens: list[int], cache: list) -> tuple[mx.array, mx.array]:
        """An autoregressive step: the last position's logits after feeding `tokens`, evaluated,
        and the hidden states (lazy past the last position's)."""
        with self.small_forwards():
            hidden = self.hidden(tokens, cache)
            logits = self.logits(hidden)[0, -1]
            mx.eval(logits)
        return logits, hidden

    def small_forwards(self, rows: int = 0):
        """Context for decode steps and verifies (1 to k+1 tokens): MKL on one thread (see
        compute.blas_threads); `rows`: a batched step's most rows per product, all kept on the
        small-row kernel (small_gemm.rows_up_to). Evaluate inside it."""
        if not rows:
            return blas_threads(1)  # every decode step alone comes here: no more than before
        from mtplx import fast_path, small_gemm

        stack = contextlib.ExitStack()
        stack.enter_context(blas_threads(1))
        stack.enter_context(small_gemm.rows_up_to(fast_path.KERNEL, rows))
        return stack


def _macs(module) -> int:
    """Multiply-adds of one position through a module's matmul weights (unpacked size)."""
    return sum(m["weight"].size * (32 // m.bits if hasattr(m, "bits") else 1)
               for _, m in module.named_modules() if "weight" in m and m["weight"].ndim >= 2)


def _batch(tokens: list[int] | mx.array) -> mx.array:
    """Token ids as a (1, T) int array: a list, or an array of shape (T,) or (1, T)."""
    if isinstance(tokens, mx.array):
        return tokens if tokens.ndim == 2 else tokens[None]
    return mx.array([tokens])


def head_transform(outer):
    """What the model's own `__call__` does to the projected logits after the LM head, so that
    the runner's logits equal the model's: Gemma's final softcap, Cohere's logit_scale,
    Granite's logits_scaling."""
    args = getattr(outer, "args", None)
    cap = getattr(outer, "final_logit_softcapping", None) or getattr(args, "final_logit_softcapping", None)
    scale = getattr(args, "logit_scale", None) if getattr(args, "model_type", "") in ("cohere", "cohere2") else None
    divide = getattr(outer, "logits_scaling", None) or (getattr(args, "logits_scaling", None)
                                                        if getattr(args, "model_type", "") == "granite" else None)

    def transform(logits: mx.array) -> mx.array:
        if scale:
            logits = logits * scale
        if divide:
            logits = logits / divide
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    return transform
