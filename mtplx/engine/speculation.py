"""MTP self-speculation: draft k tokens with the MTP head, verify them in one trunk forward.
Where a request gives a predicted output and the reply follows it, the prediction's tokens are the
drafts instead (engine/prediction.py), up to 16 a verify.

Acceptance is exact. At temperature 0 a draft is kept when it equals the trunk's argmax (and the
drafts themselves are greedy: speed only, output unchanged). Above 0, draft d drawn from q is
kept with probability min(1, p(d)/q(d)); the first rejected position draws from the residual
max(0, p - q), and when every draft is kept the verify's last position gives a bonus token. The
output distribution is therefore exactly the trunk's.

Rollback keeps the trunk cache equal to what feeding only the kept tokens would give: attention
KV is trimmed, recurrent (GatedDeltaNet) layers take the state the verify captured at the last
kept position, or, for recurrent layers that cannot capture, are rewound and the kept tokens
replayed.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mtplx.engine import cache_state
from mtplx.engine.runner import ModelRunner
from mtplx.engine.sampling import Sampler, probabilities
from mtplx.engine.stats import GenerationStats


def accept_drafts(logits: mx.array, drafts: list[int], dists: list, sampler: Sampler) -> tuple[int, int]:
    """How many drafts to keep, and the token the verify adds after them.

    `logits` has one row per verify position (len(drafts) + 1); `dists` holds each draft's
    distribution q (None when drafting was greedy)."""
    params = sampler.params
    if params.greedy:
        targets = mx.argmax(logits, axis=-1).tolist()
        kept = greedy_kept(drafts, targets)
        return kept, targets[kept]
    p = probabilities(logits, params)
    for i, (d, q) in enumerate(zip(drafts, dists)):
        if sampler.uniform() >= (p[i, d] / q[d]).item():
            residual = mx.maximum(p[i] - q, 0.0)
            total = residual.sum().item()
            return i, sampler.draw(residual / total if total > 0 else p[i])
    return len(drafts), sampler.draw(p[len(drafts)])


def draw_draft(runner: ModelRunner, logits: mx.array, sampler: Sampler, whole: bool = False) -> tuple[int, mx.array | None]:
    """One draft token from one position's logits, and its distribution q over the whole
    vocabulary (None when greedy). `logits` are the runner's `draft_logits` (maybe over the draft
    vocabulary) unless `whole`; a narrower q is zero outside it, which the acceptance test
    min(1, p/q) and the residual max(0, p - q) handle exactly."""
    narrowed = not whole and runner.draft_ids is not None
    if sampler.params.greedy:
        index = mx.argmax(logits)
        return int((runner.draft_token(index) if narrowed else index).item()), None
    q = probabilities(logits, sampler.params)
    index = sampler.draw(q)
    if not narrowed:
        return index, q
    token = int(runner.draft_ids[index].item())
    return token, mx.zeros((runner.vocab_rows,), dtype=q.dtype).at[runner.draft_ids].add(q)


CATCH_UP = 64  # pending MTP pairs after which predicted rounds feed them to the head


def _one_hot(token: int, rows: int) -> mx.array:
    """A predicted draft's q: all its mass on the token, so it is kept with probability p(token)
    and a rejection draws from p without it (accept_drafts), exactly the trunk's distribution."""
    return mx.zeros((rows,), dtype=mx.float32).at[token].add(1.0)


def greedy_kept(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the trunk's argmax at their position."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return kept


class Speculator:
    def __init__(self, runner: ModelRunner, sampler: Sampler, state, last_hidden: mx.array, first: int | list[int],
                 stats: GenerationStats, eos_ids: set[int] = frozenset(), shape=None, mask=None,
                 prediction=None, reply: list[int] | None = None, head: bool = True):
        """`last_hidden`: the trunk's hidden before each token of `first` (one token, or the first
        few sampled by plain steps), whose pairs the MTP head has not yet seen. `prediction`
        (engine/prediction.Prediction) drafts where `reply` (the tokens generated so far, a live
        list) follows it. `head=False`: no MTP head (decoding is autoregressive), so only
        `predicted_round` is used and no pairs are kept for a head."""
        self.runner, self.sampler, self.state, self.stats = runner, sampler, state, stats
        # shape(logits, drafted): one position's logits under the request's tool rule. Drafts and
        # every verify row go through the same transform as an autoregressive pick, so the kept
        # tokens are exactly what AR decoding under the rule gives.
        self.shape = shape
        # mask(logits): a history-free rule, the same at every position (any leading shape); it
        # keeps greedy drafts lazy, where `shape` needs each draft on the host.
        self.mask = mask
        self.eos_ids = eos_ids
        self.params = sampler.params
        # MTP pairs (hidden at t, token at t+1) not yet fed to the MTP cache; the last pair's
        # output starts the next draft chain.
        first = [first] if isinstance(first, int) else list(first)
        self.pending_hidden = last_hidden
        self.pending_tokens = first
        self.last = first[-1]  # generated, not yet fed to the trunk
        self.last_logprobs: list = []  # the last round's kept tokens' entries, when the request asks
        self.prediction, self.reply, self.head = prediction, reply, head
        self.predicted = False  # whether the last round's drafts came from the prediction
        self.native_chain = False  # whether this round's chain ran in C (engine/native_draft.py)

    def _chain_start(self) -> mx.array:
        """The head's output for the last pending pair, (1, 1, H), which starts a draft chain; the
        pairs before it only have their keys and values stored."""
        return self.runner.draft_hidden(self.pending_hidden, self.pending_tokens, self.state.mtp, last=True)

    def _draft(self, k: int) -> tuple[list[int], list]:
        """k drafts, each read on the host (a tool rule or sampling needs the tokens as ints)."""
        runner = self.runner
        m = self._chain_start()
        drafts, dists = [], []
        narrow = self.shape is None  # a rule that reads history judges the whole vocabulary
        for i in range(k):
            if narrow:
                logits = runner.draft_logits(m)[0, -1]
                token, q = draw_draft(runner, logits if self.mask is None else self.mask.on_drafts(logits, runner),
                                      self.sampler)
            else:
                token, q = draw_draft(runner, self.shape(runner.logits(m)[0, -1], drafts), self.sampler, whole=True)
            drafts.append(token)
            dists.append(q)
            if i < k - 1:
                m = runner.draft_hidden(m, [drafts[-1]], self.state.mtp)
        return drafts, dists

    def _lazy_drafts(self, k: int) -> mx.array:
        """k greedy drafts as one lazy (k,) array: each argmax feeds the next head step on the
        device, so the chain and the verify after it run as one graph with one host sync."""
        runner = self.runner
        native = runner.native_draft()
        if native is not None:
            # The whole chain in C (engine/native_draft.py). The pending pairs' keys and values it
            # computed go to the head's cache, as the MLX chain's first step would put them there.
            bias = None if self.mask is None else self.mask.draft_vector(runner)
            drafts = native.chain(self.pending_hidden, self.pending_tokens, self.state.mtp, k, bias)
            if drafts is not None:
                self.state.mtp.update_and_fetch(*native.pending_kv(len(self.pending_tokens)))
                self.native_chain = True
                return mx.array(drafts, dtype=mx.uint32)
        m = self._chain_start()
        drafts = []
        for i in range(k):
            logits = runner.draft_logits(m)[0, -1:]
            if self.mask is not None:  # a history-free rule narrows with the drafts (logit_mask.py)
                logits = self.mask.on_drafts(logits, runner)
            drafts.append(runner.draft_token(mx.argmax(logits, axis=-1)))
            if i < k - 1:
                m = runner.draft_hidden(m, drafts[-1], self.state.mtp)
        drafts = mx.concatenate(drafts)
        mx.async_eval(drafts)  # the head computes while the verify graph is built
        return drafts

    def _masked(self, logits: mx.array) -> mx.array:
        return logits if self.mask is None else self.mask(logits)

    def kept_logprobs(self, rows: mx.array, tokens: list[int]) -> list:
        """Each kept token's entry from its verify row: the distribution its keep was judged on."""
        if self.params.logprobs is None:
            return []
        from mtplx.engine.logprobs import of_rows

        return of_rows(rows, tokens, self.params.logprobs, self.runner.checkpoint.tokenizer)

    def round(self, k: int, room: int | None = None) -> tuple[list[int], list[int], int]:
        """One draft+verify round. Returns (new tokens, drafts, drafts accepted). `room`: how many
        tokens a round may draft from a prediction (default k)."""
        predicted = self.predicted_drafts(room or k)
        if predicted:
            return self.predicted_round(predicted)
        self.predicted = False
        with self.runner.small_forwards():
            return self._round(k)

    def predicted_drafts(self, room: int) -> list[int]:
        """The prediction's drafts for the next round; none when it has fewer than two (one is no
        better than an MTP draft, or than an AR step)."""
        drafts = self.prediction.drafts(self.reply, room) if self.prediction is not None else []
        return drafts if len(drafts) > 1 else []

    def predicted_round(self, drafts: list[int]) -> tuple[list[int], list[int], int]:
        self.predicted = True
        with self.runner.small_forwards():
            return self._round(len(drafts), drafts)

    def _round(self, k: int, predicted: list[int] | None = None) -> tuple[list[int], list[int], int]:
        state, runner = self.state, self.runner
        # Greedy drafts without a tool rule never need the host until the verify is done.
        lazy = self.params.greedy and self.shape is None and predicted is None
        self.native_chain = False
        t0 = time.perf_counter()
        if lazy:
            pending = self._lazy_drafts(k)
            fed_ids = mx.concatenate([mx.array([self.last], dtype=pending.dtype), pending])
        elif predicted is not None:  # the MTP head is not run: a draft q is the prediction itself
            drafts, dists = predicted, None  # (q, one-hot, made once the logits' width is known)
            fed_ids = [self.last] + drafts
        else:
            drafts, dists = self._draft(k)
            fed_ids = [self.last] + drafts
        t1 = time.perf_counter()
        capture = runner.can_capture
        saved = None if capture else cache_state.recurrent_copy(state.trunk)
        cache_state.set_capture(state.trunk, capture)
        hidden = runner.hidden(fed_ids, state.trunk)
        logits = self._masked(runner.logits(hidden)[0])
        if lazy:
            targets = mx.argmax(logits, axis=-1)
            # After a C chain, the hidden states and the head's cache too: the next chain reads them
            # on the host.
            host_reads = [hidden, state.mtp.keys, state.mtp.values] if self.native_chain else []
            mx.eval(targets, pending, *host_reads)
            drafts, targets = pending.tolist(), targets.tolist()
            t2 = time.perf_counter()
            accepted = greedy_kept(drafts, targets)
            extra = targets[accepted]
        else:
            if self.shape is not None:
                logits = mx.stack([self.shape(logits[i], drafts[:i]) for i in range(k + 1)])
            if dists is None:
                dists = [None if self.params.greedy else _one_hot(d, logits.shape[-1]) for d in drafts]
            mx.eval(logits)
            t2 = time.perf_counter()
            accepted, extra = accept_drafts(logits, drafts, dists, self.sampler)
        t3 = time.perf_counter()
        fed = [self.last] + drafts
        # Nothing after an end-of-sequence token is kept: the cache must end where the turn did.
        eos_at = next((i for i, d in enumerate(drafts[:accepted]) if d in self.eos_ids), None)
        if eos_at is not None:
            accepted, extra = eos_at, drafts[eos_at]
        kept = accepted + 1
        self.last_logprobs = self.kept_logprobs(logits[:kept], drafts[:accepted] + [extra])
        if capture or not runner.has_recurrent:
            cache_state.keep_verified(state.trunk, len(fed), kept)
        elif kept < len(fed):
            cache_state.rewind(state.trunk, saved, len(fed))
            hidden = runner.hidden(fed[:kept], state.trunk)
        cache_state.set_capture(state.trunk, False)
        state.tokens.extend(fed[:kept])
        state.length += kept
        if predicted is None:
            # the speculative MTP entries of draft steps 2..k (a C chain keeps its own off the cache)
            state.mtp.trim(0 if self.native_chain else k - 1)
            self.pending_hidden = hidden[:, :kept, :]
            self.pending_tokens = drafts[:accepted] + [extra]
        elif self.head:  # the head saw nothing this round: its pairs wait for the next MTP draft
            self.pending_hidden = mx.concatenate([self.pending_hidden, hidden[:, :kept, :]], axis=1)
            self.pending_tokens = self.pending_tokens + drafts[:accepted] + [extra]
            if len(self.pending_tokens) > CATCH_UP:
                # The head is fed all but the last pair now (the last starts its next chain), so a
                # long run along the prediction never piles up pairs or a chain of copies of them.
                runner.extend_head(self.pending_hidden[:, :-1, :], self.pending_tokens[:-1], state.mtp)
                self.pending_hidden, self.pending_tokens = self.pending_hidden[:, -1:, :], self.pending_tokens[-1:]
        self.last = extra
        # In a lazy round draft_s is building the chain; its compute lands in verify_s.
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self.stats.sample_s += t3 - t2
        return drafts[:accepted] + [extra], drafts, accepted
