"""Carries the session bank's plans out on the engine thread: restores caches from an entry,
captures recurrent state at the planned checkpoints, feeds a finished turn's tail, hands the
bank the turn as an entry, and prefills the renderings it names as idle work, one chunk per step
(so a request arriving meanwhile waits at most one chunk).

The bank (mtplx/bank) plans and stores; this module is the only one that runs the model for it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mtplx.bank.anchors import GENERATION_END, MESSAGE, Anchor
from mtplx.bank.bank import Outcome, SessionBank, TurnPlan, TurnRecord
from mtplx.bank.entry import Entry
from mtplx.chat import sent_back
from mtplx.engine.shared_prompt import SHARE_FROM
from mtplx.state import snapshot
from mtplx.state.turn import StartPoint, TurnState

log = logging.getLogger("mtplx.bank")

# Render-ahead runs in chunks of at most this many tokens. Where a chunk cannot step aside for an
# arriving request (engine/preemption.py; not on sharded ranks) the request waits for the chunk in
# flight, so it must be small (~20 ms for the tiny models on the CPU fast path).
# Chunking leaves a prefill's values bit-identical on MLX's reference CPU path and changes them only
# in fp32 rounding on MKL (whose rows round by the call's row count), as any restore point does.
IDLE_CHUNK = 64
# A chunk's attention grows with the context it reads (a 16-token chunk of tiny-dense took 17 ms at
# 2k tokens of context and 42 ms at 8k with engine/cpu_attention.py; 26 and 70 ms with MLX's own
# attention, which is why the halving once began at 1k). So a longer rendering runs smaller chunks,
# keeping the wait of a request that arrives about the same; the floor bounds the fixed cost per
# forward (~10 ms on the tiny models).
IDLE_CHUNK_MIN = 16
# With only an SSD file write left (on the bank's I/O thread), each idle step waits this long for
# it, then lets a queued request in: the most a request waits behind a write.
WRITE_POLL_S = 0.005


def idle_chunk(length: int, largest: int = IDLE_CHUNK) -> int:
    """The render-ahead chunk for a rendering of `length` tokens: `largest` up to 1k tokens, half
    of it up to 4k, a quarter beyond (powers of two, so cold and restored prefills share
    boundaries), never below IDLE_CHUNK_MIN."""
    chunk = largest if length <= 1024 else largest // 2 if length <= 4096 else largest // 4
    return max(min(chunk, largest), min(IDLE_CHUNK_MIN, largest))


def restore(entry: Entry, position: int) -> TurnState:
    """Fresh caches holding `entry`'s state at `position` (a point the planner chose)."""
    snap = entry.trunk
    if position != len(entry.tokens) and position in entry.checkpoints:
        # recurrent and sliding-window layers from the checkpoint there (their state at the end
        # cannot be cut back to it); full attention cut from the end
        snap = snapshot.at_checkpoint(snap, entry.checkpoints[position], position)
    trunk = snapshot.restore(snapshot.truncate_kv(snap, position))
    mtp, pending = None, None
    if entry.mtp is not None:
        keep = min(position, entry.mtp.offset)
        mtp = snapshot.restore(snapshot.truncate_kv([entry.mtp], keep))[0]
        if keep == position - 1:  # the entry's end: rebuild pair (h[p-1], x[p]) from the kept hidden
            pending = entry.last_hidden
    return TurnState(trunk, mtp, list(entry.tokens[:position]), position, mtp_pending=pending)


def entry_from_state(state: TurnState, plan: TurnPlan, checkpoints: dict[int, list], anchors: list[Anchor],
                     last_hidden, cut: int | None = None) -> Entry:
    """An independent copy of a turn's caches (they go on being written by the next request).
    `cut`: a prompt prefix only, its first `cut` tokens (the state is a turn's that goes on or
    stopped there): recurrent layers take the checkpoint at `cut` where the caches went past it,
    and the MTP head keeps the pairs before it (`last_hidden`, the hidden at cut - 1, completes
    the next on restore)."""
    end = state.length if cut is None else cut
    trunk = snapshot.snapshot(state.trunk, upto=end)
    if end < state.length and end in checkpoints:
        trunk = snapshot.at_checkpoint(trunk, checkpoints[end], end)
    mtp = snapshot.snapshot([state.mtp], upto=None if cut is None else cut - 1)[0] if isinstance(state.mtp, KVCache) else None
    kept = {p: a for p, a in checkpoints.items() if p < end}
    return Entry(tuple(state.tokens[:end]), plan.identity, trunk, kept, mtp,
                 mx.array(last_hidden) if last_hidden is not None else None, anchors, plan.session)


@dataclass
class BankedTurn:
    """One request's side of the bank: its plan, where it starts, and the recurrent state the
    prefill captured at the plan's checkpoints (kept here, per request, until commit)."""

    plan: TurnPlan
    start: StartPoint
    captures: dict[int, list] = field(default_factory=dict)

    @property
    def checkpoints(self) -> tuple[int, ...]:
        return self.plan.restore.captures

    def capture(self, position: int, recurrent: list) -> None:
        """The prefill's checkpoint hook."""
        self.captures[position] = recurrent


@dataclass
class RenderJob:
    """One rendering to prepare ahead (idle work), advanced one prefill chunk per idle step."""

    tokens: list[int]
    use_mtp: bool
    session: str | None
    gen: object = None  # its Generation, once the first step ran
    preempted: bool = False  # a request arrived: stop at the next chunk boundary, keep what is done


# Renderings queued for idle time, newest first: a few agents' next turns (each turn queues one
# or two, and an agent's next turn drops its previous ones). Past this, the oldest are dropped.
MAX_JOBS = 8


def _extends(tokens, prefix: list[int]) -> bool:
    return len(prefix) <= len(tokens) and list(tokens[: len(prefix)]) == prefix


class BankExecutor:
    def __init__(self, runner, bank: SessionBank, chunk_size: int, waiting: Callable[[], bool] | None = None):
        """`waiting()`: whether a request waits for the engine thread; render-ahead asks it between
        layers and steps aside (engine/preemption.py). None: its chunks run whole."""
        self.runner, self.bank, self.chunk_size, self.waiting = runner, bank, chunk_size, waiting
        self.idle_chunk = min(chunk_size, IDLE_CHUNK)
        # Render-ahead prefills, advanced one chunk per idle step: (job, its step iterator).
        self.jobs: deque[tuple[RenderJob, Iterator]] = deque()

    # -- a request --------------------------------------------------------------------------
    def begin(self, request, use_mtp: bool) -> BankedTurn:
        """Plan the request's restore and carry it out; a damaged entry is dropped and the
        request computed cold."""
        prompt = request.prompt
        prepared = self._preempt_render_ahead(prompt)
        plan = self.bank.plan(prompt, use_mtp=use_mtp, session=request.session, chat=request.chat,
                              request_id=request.request_id)
        entry_id, position = plan.restore.entry_id, plan.restore.position
        state, source, cause = None, "cold", plan.cause
        if entry_id is not None and request.prompt_logprobs is not None:
            # a scored prompt needs every position's logits, a restored prefix has none
            entry_id, cause = None, "prompt log-probabilities asked: every position computed"
        if entry_id is not None:
            try:
                entry, source = self.bank.get(entry_id, plan.identity)
                state = restore(entry, position)
                entry.used(position)
            except Exception as exc:  # a damaged entry is dropped, never served
                log.warning("restore from %s failed (%s); computing cold", entry_id, exc)
                self.bank.evict(entry_id, str(exc))
                state, source, cause = None, "cold", f"restore failed, computed cold: {exc}"
        if prepared is None and state is not None and entry.origin == "render_ahead":
            prepared = "complete"
        cached = state.length if state else 0
        if prepared and not prepared.startswith("complete") and plan.ceiling and cached < plan.ceiling:
            # The miss is idle time, not the template: say how far the preparation had come.
            cause = f"render-ahead {prepared} when the request came"
        self.bank.record(Outcome(request.request_id, len(prompt), plan.ceiling, state.length if state else 0, source,
                                 plan.restore.anchor, cause, plan.plan_ms))
        if state is not None:
            self.bank.notify("restored", f"{state.length} tokens from {entry_id} at "
                                         f"{plan.restore.anchor or 'a cut'} (plan {plan.plan_ms:.2f} ms)")
        start = StartPoint(state, source, plan.restore.anchor, plan.ceiling, cause,
                           entry_id if state is not None else None, prepared,
                           entry.origin if state is not None else None)
        return BankedTurn(plan, start)

    def commit(self, turn: BankedTurn, gen, finished) -> None:
        """Hand the bank the turn as computed (prompt + generated tokens); queue the renderings it
        names. `gen`: the request's Generation; `finished`: its Finished event."""
        state = gen.state
        if state is None:
            return
        if gen.prefill_cut is not None:
            return self._keep_partial(turn, gen)
        anchors = list(turn.plan.anchors)
        ended_by_eos = gen.finish_reason == "stop" and not gen.stream.stopped
        if ended_by_eos:
            self._feed_to_end(gen, list(gen.request.prompt) + gen.generated + [gen.stop_token])
            anchors.append(Anchor(state.length, GENERATION_END))
        entry = entry_from_state(state, turn.plan, turn.captures, anchors, gen.last_hidden_at_end)
        # A reply cut by max_tokens still goes back into the client's history, so it is rendered
        # ahead too; a cancelled one, or one ended by a stop string, is not sent back as it is.
        reply, _ = sent_back(self.bank.tokenizer, gen.request.chat, finished.reply, (), gen.request.prompt)
        record = TurnRecord(entry, gen.request.chat, reply, sent_back=ended_by_eos or gen.finish_reason == "length")
        self._queue_first([RenderJob(tokens, gen.use_mtp, turn.plan.session) for tokens in self.bank.commit(record)])

    def share_running(self, turn: BankedTurn, gen, shared: int, held: int, state: TurnState) -> int:
        """A running turn that has computed its first `shared` prompt tokens (decoding, alone or
        in a batch, or prefilling past them) shares them with a request arriving now: keep its
        prompt up to the last point at or before `shared` where its exact state is at hand, so
        that request restores it instead of computing it again (engine/shared_prompt.py).
        `held`: what the bank holds of it already (what it restored, or was kept of it before);
        `state`: its caches as they stand (Scheduler.state_of: a batched row's are in its batch).
        Returns the point kept, else `held`.

        Its prompt's attention KV is never written again (the prefill and decoding append after
        it; a batch writes its own merged copy), so any prefix of it is exact. Recurrent and sliding-window
        state exists only where the prefill captured it, with the hidden that completes the MTP
        pair there (Generation.hidden_at)."""
        if not self.bank.recurrent:
            cut, last_hidden = shared, None  # restored one short of it, the MTP pairs all inside
        else:
            points = [p for p in turn.captures if p <= shared and (not gen.use_mtp or p in gen.hidden_at)]
            cut = max(points, default=0)
            last_hidden = gen.hidden_at.get(cut)
        if cut - held < SHARE_FROM:
            return held
        entry = entry_from_state(state, turn.plan, turn.captures, [a for a in turn.plan.anchors if a.position <= cut],
                                 last_hidden, cut)
        entry.origin = "shared_prompt"
        if entry.last_hidden is not None:  # (a prefill's is still lazy: computed now, not at the restore)
            mx.eval(entry.last_hidden)
        self.bank.put(entry)
        self.bank.notify("kept_partial", f"{entry.entry_id}: a running turn's shared prompt, its first {cut} tokens")
        return cut

    def _keep_partial(self, turn: BankedTurn, gen, origin: str = "turn") -> None:
        """A prefill cancelled between chunks: keep the prompt prefix it computed, so a client that
        gave up and resends (Claude Code after 300 s) restores it instead of starting over, while
        the engine was freed at once. Stored like a turn's end: the MTP head's pairs stop one short
        of the cut (the last chunk's reached the prompt token there) and the hidden state there
        completes the next pair on restore."""
        cut = gen.prefill_cut
        anchors = [a for a in turn.plan.anchors if a.position <= cut]
        entry = entry_from_state(gen.state, turn.plan, turn.captures, anchors, gen.last_hidden, cut)
        entry.origin = origin
        self.bank.put(entry)
        what = ("a preempted render-ahead" if origin == "render_ahead" else "a prewarmed prompt" if gen.request.prefill_only
                else "a cancelled prefill")
        self.bank.notify("kept_partial", f"{entry.entry_id}: {what}'s first {cut} tokens")

    @staticmethod
    def _feed_to_end(gen, target: list[int]) -> None:
        """Feed generated tokens the decode loop sampled but never fed (the last one, EOS)."""
        state = gen.state
        if state.tokens != target[: len(state.tokens)]:
            return  # the cache went past the turn's end (a stop string): keep what was computed
        rest = target[len(state.tokens):]
        if rest:
            gen.feed_tail(rest)

    # -- idle work --------------------------------------------------------------------------
    def _queue_first(self, new: list[RenderJob]) -> None:
        """A turn's renderings go ahead of older work: the client that just got its reply is the
        one whose next request comes soonest (older jobs are mostly for conversations that moved on
        or ended). A queued job that one of the new ones extends is dropped: the new job restores
        whatever of it the bank holds and computes the rest on the way (an agent's tool chain queues
        a stripped rendering per turn, each a prefix of the next)."""
        stale = [i for i, (job, _) in enumerate(self.jobs)
                 if any(_extends(n.tokens, job.tokens) and n.session == job.session for n in new)]
        self._drop(stale)
        for job in reversed(new):
            self.jobs.appendleft((job, self._render_ahead(job)))
        # The queue is bounded: clients that never leave idle time (many sessions back to back)
        # would otherwise queue jobs without end, each one under way holding its partial state.
        # The oldest go; one under way keeps its computed prefix in the bank, under its budget.
        self._drop(list(range(MAX_JOBS, len(self.jobs))))

    def _drop(self, indices: list[int]) -> None:
        """Remove queued jobs; one under way stops at its chunk boundary and keeps what it did."""
        for i in sorted(indices, reverse=True):
            job, steps = self.jobs[i]
            if job.gen is not None:
                job.preempted = True
                for _ in steps:  # returns at once: the prefill checks `preempted` before its next chunk
                    pass
            del self.jobs[i]

    def _preempt_render_ahead(self, prompt) -> str | None:
        """A request arrived. A render-ahead of a rendering the request's prompt extends is
        progressive: it stops at its chunk boundary (it is suspended at one), its computed prefix is
        stored as an entry the request's plan restores from, and the job is dropped (the request
        computes the rest). So a request that comes before its render-ahead ends still skips what
        was done. Any other job stays suspended where it is, costing the request nothing (storing
        its state would copy megabytes the request has no use for), and goes on at the next idle step.
        Returns how far the render-ahead of `prompt`'s own rendering had come (None: none queued)."""
        covered = [i for i, (job, _) in enumerate(self.jobs) if _extends(prompt, job.tokens)]
        jobs = [self.jobs[i][0] for i in covered]
        self._drop(covered)  # the ones under way stop at their chunk boundary and keep what they did
        note = None
        for job in jobs:
            if job.gen is None:  # not started: nothing kept
                note = note or f"queued: not started ({len(job.tokens)} tokens)"
            else:
                done = job.gen.prefill_cut or job.gen.stats.cached_tokens  # no chunk yet: what it restored
                note = f"partial: {done} of {len(job.tokens)} tokens"
        return note

    def _render_ahead(self, job: RenderJob) -> Iterator:
        """Compute state for the next request's rendering, one prefill chunk per step."""
        from mtplx.engine.generation import Generation
        from mtplx.engine.request import GenerationRequest

        tokens, use_mtp, session = job.tokens, job.use_mtp, job.session
        if self.bank.holds(tokens):
            return  # already held, state at its end included
        plan = self.bank.plan(tokens, use_mtp=use_mtp, session=session)
        state = None
        if plan.restore.entry_id:
            try:
                base = self.bank.get(plan.restore.entry_id, plan.identity)[0]
                state = restore(base, plan.restore.position)
                base.used(None)  # the views show the turns' restores, not this one
            except Exception as exc:  # a damaged SSD entry: drop it and compute this branch cold
                self.bank.evict(plan.restore.entry_id, str(exc))
        # Chunks that step aside between layers keep an arriving request's wait at about a layer
        # whatever their size, so they stay whole-size at any context (fewer forwards: tiny-hybrid
        # rendered a 3k-token strip variant in ~1.8 s instead of ~2.5 s); chunks that run whole
        # shrink as the context grows, which bounds that wait.
        chunk = self.idle_chunk if self.waiting is not None else idle_chunk(len(tokens), self.idle_chunk)
        gen = Generation(self.runner, GenerationRequest(tuple(tokens), source="render_ahead", session=session),
                         use_mtp=use_mtp, depth=1, chunk_size=chunk, eos_ids=set(), submitted_at=time.monotonic())
        turn = BankedTurn(plan, StartPoint(state))
        job.gen = gen
        for _ in gen.prefill(turn.start, turn.checkpoints, turn.capture, lambda: job.preempted, self.waiting):
            yield
        if gen.finish_reason == "cancelled":  # preempted by a request: keep the computed prefix
            if gen.prefill_cut is not None:
                self._keep_partial(turn, gen, origin="render_ahead")
            return
        # The whole variant is in the trunk; its last hidden completes the MTP history on restore.
        entry = entry_from_state(gen.state, plan, turn.captures, [*plan.anchors, Anchor(len(tokens), MESSAGE)],
                                 gen.last_hidden)
        entry.origin = "render_ahead"
        # Making the entry and storing it are ~6 ms each on the tiny models: a request that arrives
        # in between goes first (a request whose prompt extends this rendering runs the store at
        # once, in _preempt_render_ahead, and restores from it).
        yield
        self.bank.put(entry)

    @property
    def has_idle_work(self) -> bool:
        return bool(self.jobs) or self.bank.writes_due

    def idle_step(self) -> bool:
        """Run one unit of idle work (a step of an SSD write, else one render-ahead chunk); returns
        whether any remains. A write's file goes to the bank's I/O thread, so render-ahead runs
        while it is written; with nothing else to do the thread waits a moment for the file."""
        if self.bank.writes_due and self.bank.persist_one():
            return True
        while self.jobs:
            try:
                next(self.jobs[0][1])
                return True
            except StopIteration:  # its last step stored the entry: that was this step's work
                self.jobs.popleft()
                return self.has_idle_work
            except Exception as exc:  # idle work is an optimisation: a failure drops it, never the engine
                log.exception("render-ahead failed")
                self.bank.notify("render_ahead_failed", f"{type(exc).__name__}: {exc}")
                self.jobs.popleft()
        if self.bank.writes_due:
            self.bank.persist_one(wait=WRITE_POLL_S)  # only the file is left: a request waits at most this long
        return self.has_idle_work
