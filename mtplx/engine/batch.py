"""Several sequences decoding together: one batched forward per step, every row its own request.

A DecodeBatch holds the running Generations of one mode (MTP or AR) with their caches merged
(batch_cache). An MTP round drafts for every row at once (the MTP head runs batched: the first
draft step takes each row's pending pairs, right-padded, then one token per row per step), runs
one verify over k + 1 tokens per row, and accepts per row with that row's own sampler and tool
rule, so a row keeps exactly what it would keep alone. Rollback is per row: attention rows are
cut to their kept length, recurrent rows take the state the verify captured there.

Rows differ in how many drafts they may take (depth, the tokens left before max_tokens): the
batch drafts k = the largest, and a row allowed k_b < k pads its chain with token 0 and judges
only its first k_b drafts; the padding is rolled back like any rejected draft.

The batch knows arrays, samplers and caches, never events, queues or the bank.
"""

from __future__ import annotations

import dataclasses
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mtplx.engine import batch_cache, cache_state
from mtplx.engine.batch_cache import RaggedKVCache
from mtplx.engine.compiled import STEP_TOKENS
from mtplx.engine.generation import Generation
from mtplx.engine.speculation import accept_drafts, draw_draft
from mtplx.state.turn import TurnState


class DecodeBatch:
    def __init__(self, runner, gens: list[Generation]):
        self.runner, self.gens = runner, list(gens)
        self.mtp_mode = gens[0].speculator is not None
        self.trunk = batch_cache.merge([g.state.trunk for g in gens])
        self.mtp = RaggedKVCache.from_rows([g.state.mtp for g in gens]) if self.mtp_mode else None
        self._hold(self.gens)

    def _hold(self, gens: list[Generation]) -> None:
        """The batch holds these rows' caches now: their own copies go (else every batched row's KV
        sat in memory twice while it decoded), and come back from release or drop."""
        for gen in gens:
            gen.state.trunk = None
            if self.mtp_mode:
                gen.state.mtp = None

    def add(self, gens: list[Generation]) -> None:
        """Rows join: their caches are appended; the batch's rows stay where they are."""
        gens = list(gens)
        if any((g.speculator is not None) != self.mtp_mode for g in gens):
            raise ValueError("a batch's rows decode in one mode (MTP or AR)")
        batch_cache.add_rows(self.trunk, [g.state.trunk for g in gens])
        if self.mtp is not None:
            self.mtp.add([g.state.mtp for g in gens])
        self.gens += gens
        self._hold(gens)

    def drop(self, gens: list[Generation]) -> None:
        """Rows leave with their own caches (copies); the batch's last rows move into the slots they
        free, and `gens` follows that order. Leaves at least one row (release ends a batch)."""
        leaving = [next(b for b, g in enumerate(self.gens) if g is gen) for gen in gens]
        if len(set(leaving)) >= len(self.gens):
            raise ValueError("drop leaves no row; release the batch instead")
        rows, order = batch_cache.drop_rows(self.trunk, leaving)
        heads = self.mtp.drop(leaving, order) if self.mtp is not None else [None] * len(gens)
        for gen, trunk, head in zip(gens, rows, heads):
            gen.state.trunk = trunk
            if self.mtp is not None:
                gen.state.mtp = head
        self.gens = [self.gens[o] for o in order]

    def row_state(self, gen: Generation) -> TurnState:
        """A row's state as it stands, its caches viewed in the batch's buffers: for a copy taken at
        once (a running turn's prompt kept for a request that shares it: bank_executor.share_running)."""
        b = next(i for i, g in enumerate(self.gens) if g is gen)
        mtp = self.mtp.view(b) if self.mtp is not None else gen.state.mtp
        return dataclasses.replace(gen.state, trunk=batch_cache.row_views(self.trunk, b), mtp=mtp)

    def release(self) -> None:
        """Hand every row its caches back as one-sequence caches (the batch is done with them)."""
        rows = batch_cache.split(self.trunk, len(self.gens))
        for b, (gen, trunk) in enumerate(zip(self.gens, rows)):
            gen.state.trunk = trunk
            if self.mtp is not None:
                gen.state.mtp = self.mtp.row(b)
        mx.eval([a for g in self.gens for c in g.state.trunk for a in batch_cache.layer_arrays(c)] +
                [a for g in self.gens if self.mtp is not None for a in batch_cache.layer_arrays(g.state.mtp)])
        self.trunk = self.mtp = None

    def step(self) -> list[tuple]:
        """One step for every row: [(new tokens, drafts, accepted)] (drafts empty for AR rows)."""
        # A few rows per matmul: MKL on one thread, and every product on the small-row kernel however
        # many rows x tokens, as each row's alone (runner.small_forwards).
        with self.runner.small_forwards(rows=len(self.gens) * (STEP_TOKENS + 1)):
            return self._round() if self.mtp_mode else self._ar_step()

    # -- autoregressive ---------------------------------------------------------------------
    def _ar_step(self) -> list[tuple]:
        t = time.perf_counter()
        hidden = self.runner.hidden(mx.array([[g.last] for g in self.gens]), self.trunk)
        logits = self.runner.logits(hidden)[:, -1]
        mx.eval(logits)
        elapsed = time.perf_counter() - t
        plain = [b for b, g in enumerate(self.gens) if _plain_greedy(g)]
        argmax = dict(zip(plain, mx.argmax(self._masked(logits)[mx.array(plain)], axis=-1).tolist())) if plain else {}
        out = []
        for b, gen in enumerate(self.gens):
            gen.stats.verify_s += elapsed
            gen.state.tokens.append(gen.last)
            gen.state.length += 1
            out.append(([argmax[b] if b in argmax else gen.pick(logits[b])], [], 0))
        return out

    # -- MTP --------------------------------------------------------------------------------
    def _round(self) -> list[tuple]:
        runner, gens = self.runner, self.gens
        specs = [g.speculator for g in gens]
        ks = [g.draft_budget() for g in gens]
        k = max(ks)
        # Plain greedy rows (no tool rule) chain their drafts on the device, as a row alone does:
        # argmax feeds the next head step as an array and the round syncs with the host once.
        lazy = all(s.params.greedy and s.shape is None for s in specs)
        t0 = time.perf_counter()
        # Greedy chains in C where the head allows (engine/native_draft.py): the rows step together,
        # in two groups on two threads.
        drafts, dists = (self._draft_native(specs, k) if lazy else None), None
        native = drafts is not None
        if not native:
            m = self._pending_pairs(specs)
            drafts, dists = self._draft_lazy(m, k) if lazy else self._draft(m, specs, ks, k)
        t1 = time.perf_counter()
        fed = mx.concatenate([mx.array([[s.last] for s in specs]), drafts], axis=1) if lazy else \
            mx.array([[s.last] + d for s, d in zip(specs, drafts)])
        cache_state.set_capture(self.trunk, True)
        hidden = runner.hidden(fed, self.trunk)
        logits = self._masked(runner.logits(hidden))
        if any(s.shape is not None for s in specs):
            logits = mx.stack([logits[b] if s.shape is None else
                               mx.stack([s.shape(logits[b, i], drafts[b][:i]) for i in range(k + 1)])
                               for b, s in enumerate(specs)])
        greedy = any(s.params.greedy for s in specs)
        targets = mx.argmax(logits, axis=-1) if greedy else None
        # After C chains, the hidden states and the head's cache too: the next chains read them on the host.
        host_reads = [hidden, self.mtp.keys, self.mtp.values] if native else []
        mx.eval([a for a in (targets, drafts if lazy else None) if a is not None] + ([] if greedy else [logits])
                + host_reads)
        t2 = time.perf_counter()
        if lazy:
            drafts = drafts.tolist()
        fed = [[s.last] + d for s, d in zip(specs, drafts)]
        targets = targets.tolist() if greedy else None
        results, kept = [], []
        for b, (spec, kb) in enumerate(zip(specs, ks)):
            mine = drafts[b][:kb]
            if spec.params.greedy:
                accepted = 0
                while accepted < kb and mine[accepted] == targets[b][accepted]:
                    accepted += 1
                extra = targets[b][accepted]
            else:
                accepted, extra = accept_drafts(logits[b, : kb + 1], mine, dists[b][:kb], spec.sampler)
            # Nothing after an end-of-sequence token is kept: the cache must end where the turn did.
            eos_at = next((i for i, d in enumerate(mine[:accepted]) if d in spec.eos_ids), None)
            if eos_at is not None:
                accepted, extra = eos_at, mine[eos_at]
            kept.append(accepted + 1)
            results.append((mine[:accepted] + [extra], mine, accepted))
            spec.last_logprobs = spec.kept_logprobs(logits[b, : accepted + 1], results[-1][0])
        t3 = time.perf_counter()
        batch_cache.keep_rows(self.trunk, k + 1, kept)
        cache_state.set_capture(self.trunk, False)
        if not native:  # C chains keep their own positions off the cache
            self.mtp.trim(k - 1)  # the speculative MTP entries of draft steps 2..k, in every row
        for b, (spec, n) in enumerate(zip(specs, kept)):
            spec.state.tokens.extend(fed[b][:n])
            spec.state.length += n
            spec.pending_hidden = hidden[b : b + 1, :n, :]
            spec.pending_tokens = results[b][0]
            spec.last = results[b][0][-1]
            spec.stats.draft_s += t1 - t0
            spec.stats.verify_s += t2 - t1
            spec.stats.sample_s += t3 - t2
        return results

    def _masked(self, logits: mx.array) -> mx.array:
        """Each row's logits (B, ...) under its history-free rule (Generation.mask), if any."""
        if all(g.mask is None for g in self.gens):
            return logits
        return mx.stack([logits[b] if g.mask is None else g.mask(logits[b]) for b, g in enumerate(self.gens)])

    def _draft_masked(self, logits: mx.array) -> mx.array:
        """Each row's draft logits (B, draft vocabulary) under its history-free rule, if any."""
        if all(g.mask is None for g in self.gens):
            return logits
        return mx.stack([logits[b] if g.mask is None else g.mask.on_drafts(logits[b], self.runner)
                         for b, g in enumerate(self.gens)])

    def _pending_pairs(self, specs) -> mx.array:
        """Feed each row's pending (hidden, next token) pairs to the MTP head; (B, 1, H) of each
        row's last. Rows have 1..k+1 pairs: shorter rows are right-padded and cut back after."""
        counts = [len(s.pending_tokens) for s in specs]
        P = max(counts)
        hidden = mx.concatenate([_pad(s.pending_hidden, P, axis=1) for s in specs])
        tokens = mx.array([s.pending_tokens + [0] * (P - n) for s, n in zip(specs, counts)])
        m = self.runner.draft_hidden(hidden, tokens, self.mtp, last=mx.array(counts) - 1)
        self.mtp.trim_rows([P - n for n in counts])
        return m

    def _draft_native(self, specs, k: int) -> mx.array | None:
        """k greedy drafts per row from the C chain, each row over its own part of the head's
        batched cache, read in place; the rows' pending pairs' keys and values go to that cache.
        None where the kernel cannot run here (the MLX chain drafts)."""
        native = self.runner.native_draft()
        if native is None or self.mtp.keys is None:
            return None
        mx.eval(self.mtp.keys, self.mtp.values)
        keys, values = np.array(self.mtp.keys, copy=False), np.array(self.mtp.values, copy=False)
        rows = [(spec.pending_hidden, spec.pending_tokens, keys[b : b + 1], values[b : b + 1], self.mtp.lengths[b],
                 None if gen.mask is None else gen.mask.draft_vector(self.runner))
                for b, (gen, spec) in enumerate(zip(self.gens, specs))]
        drafts = native.chain_rows(rows, k)
        if drafts is None:
            return None  # nothing written yet: the MLX chain drafts every row
        pairs = [native.pending_kv(len(spec.pending_tokens), b) for b, spec in enumerate(specs)]
        counts = [len(s.pending_tokens) for s in specs]
        P = max(counts)
        self.mtp.update_and_fetch(mx.concatenate([_pad(kv[0], P, axis=2) for kv in pairs]),
                                  mx.concatenate([_pad(kv[1], P, axis=2) for kv in pairs]))
        self.mtp.trim_rows([P - n for n in counts])
        return mx.array(drafts, dtype=mx.uint32)

    def _draft_lazy(self, m: mx.array, k: int) -> tuple[mx.array, None]:
        """k greedy drafts per row as a lazy (B, k) array (rows allowed fewer judge only theirs)."""
        runner, steps = self.runner, []
        # Every row drafts from the draft vocabulary, a row under a history-free rule with the rule
        # taken there (logit_mask.py), each row as it would alone.
        for i in range(k):
            steps.append(runner.draft_token(mx.argmax(self._draft_masked(runner.draft_logits(m)[:, -1]), axis=-1)))
            if i < k - 1:
                m = runner.draft_hidden(m, steps[-1][:, None], self.mtp)
        drafts = mx.stack(steps, axis=1)
        mx.async_eval(drafts)  # the head computes while the verify graph is built (as a row alone)
        return drafts, None

    def _draft(self, m: mx.array, specs, ks: list[int], k: int) -> tuple[list[list[int]], list[list]]:
        """Drafts drawn on the host, per row with its own sampler and tool rule. A row without a
        rule that reads history drafts over the draft vocabulary, as it would alone
        (speculation.draw_draft)."""
        runner = self.runner
        drafts, dists = [[] for _ in specs], [[] for _ in specs]
        narrow = [s.shape is None for s in specs]  # a rule that reads history judges the whole vocabulary
        for i in range(k):
            sub = self._draft_masked(runner.draft_logits(m)[:, -1]) if any(narrow) else None
            whole = self._masked(runner.logits(m)[:, -1]) if not all(narrow) else None
            plain = [b for b, s in enumerate(specs) if i < ks[b] and narrow[b] and s.params.greedy]
            picks = dict(zip(plain, runner.draft_token(mx.argmax(sub[mx.array(plain)], axis=-1)).tolist())) if plain else {}
            for b, s in enumerate(specs):
                if i >= ks[b]:
                    token, q = 0, None  # past this row's budget: padding, never judged
                elif b in picks:
                    token, q = picks[b], None
                elif narrow[b]:
                    token, q = draw_draft(runner, sub[b], s.sampler)
                else:
                    token, q = draw_draft(runner, s.shape(whole[b], drafts[b]), s.sampler, whole=True)
                drafts[b].append(token)
                dists[b].append(q)
            if i < k - 1:
                m = runner.draft_hidden(m, mx.array([[d[-1]] for d in drafts]), self.mtp)
        return drafts, dists


def _pad(array: mx.array, length: int, axis: int) -> mx.array:
    """`array` right-padded with zeros to `length` along `axis`."""
    n = array.shape[axis]
    if n == length:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, length - n)
    return mx.pad(array, widths)


def _plain_greedy(gen: Generation) -> bool:
    return gen.params.greedy and not gen.params.penalised and gen.shape is None and gen.params.logprobs is None


def can_batch(gen: Generation) -> bool:
    """Whether a sequence may share a batch: plain attention / recurrent caches, and, for MTP,
    recurrent layers that capture per-position states (a replayed rollback is per sequence)."""
    if not batch_cache.batchable(gen.state.trunk) or gen.request.prediction:  # predicted rounds run alone
        return False
    if gen.speculator is not None:
        return (gen.runner.can_capture or not gen.runner.has_recurrent) and type(gen.state.mtp) is KVCache
    return True
