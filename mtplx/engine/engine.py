"""The engine thread: the one thread that owns every MLX array.

Callers `submit` a GenerationRequest and read its events from the returned Submission (a
queue); `cancel` sets a flag the step loop checks every step. Requests wait in one queue per
session and are admitted round-robin across sessions, so one agent's burst cannot starve another;
admitted requests run together under the scheduler (scheduler.py: prefill chunks interleaved,
one batched decode step for every running sequence). Every event is also handed to the engine's
listeners (receipt writer, metrics, TUI), which must return quickly.

The bank is consulted in two places only: `_begin` (plan: where the request starts, after
keeping a running turn's prompt the request shares: `_share_running`, shared_prompt.py) and
`_finish` (commit: what the turn computed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from mtplx.engine.request import GenerationRequest
from mtplx.errors import EngineStopped, ModelLoadError, MtplxError, RequestError
from mtplx.events import TERMINAL, BankDecision, EngineEvent, Failed, Finished, Queued
from mtplx.chat import sent_back
from mtplx.reply_ids import ReplyIds

# The draft vocabulary (draft_vocab.py) is used where the LM head is at least this share of a
# draft step's multiply-adds: Qwen3-0.6B's is 0.9, the embedded models' 0.5.
DRAFT_VOCAB_SHARE = 0.75

log = logging.getLogger("mtplx.engine")


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 256
    use_mtp: bool = True
    depth: int = 2
    context_window: int | None = None  # None: the model's max_position_embeddings
    max_batch: int = 8  # requests admitted at once (prefilling or decoding)
    memory_budget: int | None = None  # KV bytes admitted requests may reserve; None: a quarter of RAM
    share_prompts: bool = True  # a queued request waits for a prefilling one's shared prompt (shared_prompt.py)
    # While prompts are computed beside replies that stream, the share of the engine's time the
    # prompts get (scheduler.py); 1.0: a prompt chunk every step, however long the chunk takes.
    prefill_share: float = 0.5

    def __post_init__(self):
        if not (isinstance(self.max_batch, int) and self.max_batch >= 1):
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if self.memory_budget is not None and not (isinstance(self.memory_budget, int) and self.memory_budget > 0):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 16):
            raise ValueError(f"chunk_size must be an integer >= 16, got {self.chunk_size!r}")
        if not (isinstance(self.depth, int) and 1 <= self.depth <= 4):
            raise ValueError(f"depth must be in 1..4, got {self.depth!r}")
        if not (isinstance(self.prefill_share, (int, float)) and 0 < self.prefill_share <= 1):
            raise ValueError(f"prefill_share must be in (0, 1], got {self.prefill_share!r}")


class Submission:
    """A submitted request: iterate it for its events (ends after Finished or Failed)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue[EngineEvent] = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        # Called with each event (on the engine thread) once it is queued: an event loop's consumer
        # sets it to a thread-safe wake-up instead of parking a pool thread in `events.get` per event.
        self.waker: Callable[[EngineEvent], None] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: EngineEvent) -> None:
        self.events.put(event)
        if (waker := self.waker) is not None:
            waker(event)

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, TERMINAL):
                return

    def result(self) -> Finished:
        """Block until the end; raise MtplxError if it failed."""
        last = None
        for last in self:
            pass
        if isinstance(last, Failed):
            raise (RequestError if last.kind == "invalid_request" else MtplxError)(last.message)
        return last


_IDLE = object()  # _next's answer when no request waits or runs but idle work does
_STEP = object()  # _next's answer when admitted requests have work and nothing else can start


@dataclass
class _Call:
    fn: Callable
    done: queue.Queue

    def run(self) -> None:
        try:
            self.done.put((True, self.fn()))
        except Exception as exc:  # handed back to the caller's thread
            self.done.put((False, exc))


class Engine:
    def __init__(self, model_path: Path | str, config: EngineConfig = EngineConfig(), name: str | None = None,
                 bank=None, ssd=None):
        """`bank`: a BankConfig to keep a session bank (built on the engine thread), or None;
        `ssd`: an SsdConfig to persist it across restarts, or None."""
        self.model_path, self.config, self.name = Path(model_path), config, name
        self.bank_config, self.bank, self.ssd_config = bank, None, ssd
        self.bank_executor = None  # carries the bank's plans out (engine/bank_executor.py)
        self.listeners: list[Callable[[EngineEvent], None]] = []
        self._queues: OrderedDict[str, deque[Submission]] = OrderedDict()
        self._lock = threading.Condition()
        self._ready = threading.Event()
        self._stopping = False
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.checkpoint = self.runner = self.scheduler = None
        self._active: dict[str, Submission] = {}  # admitted and not yet finished (guarded by _lock)
        self.died: str | None = None  # why the engine thread ended unexpectedly (None while healthy)
        self.ssd_error: str | None = None  # why the SSD tier could not be opened, if it could not
        self.draft_vocab = None  # the tokens MTP drafts are projected onto (draft_vocab.py), learned here
        self._sharing: dict[tuple[str, str], int] = {}  # (queued, prefilling) request ids -> prefix to wait for (_waits)
        self.share_prompts = config.share_prompts  # set on the engine thread (engine.call) to compare

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout: float = 300) -> "Engine":
        self._thread = threading.Thread(target=self._main, name="mtplx-engine", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._load_error is not None:
            # The thread releases its MLX streams before it ends; raising first let the process
            # exit under it (SIGABRT, exit 134) instead of the caller's clean exit 2.
            self._thread.join(timeout=30)
            raise self._load_error
        if not self._ready.is_set():
            raise EngineStopped(f"model {self.model_path} did not load within {timeout}s")
        return self

    def cancel_all(self) -> None:
        """Cancel what runs and what waits: each ends within one prefill chunk or decode step with
        a normal Finished("cancelled"), so streams close properly (a server shutting down)."""
        with self._lock:
            subs = [s for q in self._queues.values() for s in q if isinstance(s, Submission)] + list(self._active.values())
        for sub in subs:
            sub.cancel()

    def stop(self, timeout: float = 30) -> None:
        """Cancel all work, flush the bank, and end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self.cancel_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self.died is None and self._thread is not None and self._thread.is_alive() \
            and self._load_error is None

    def health(self) -> dict:
        """Plain data for /health: whether the engine serves, what it does, the bank's tiers."""
        out = {"engine": "ok" if self.alive else ("stopped" if self._stopping else "dead"), "busy": self.busy is not None}
        if self.died:
            out["engine_error"] = self.died
        if self.runner is not None and self.runner.mtp is not None:
            # who drafts a greedy round: the C chain (engine/native_draft.py) or MLX, and why
            out["draft_chain"] = self.runner.draft_chain()
        if self.draft_vocab is not None:
            ids = self.runner.draft_ids  # what drafting uses now (None: every token)
            out["draft_vocab"] = {"tokens": int(ids.size) if ids is not None else None, "of": self.draft_vocab.vocab_size,
                                  "generated_seen": self.draft_vocab.seen, "new_rate": self.draft_vocab.new_rate()}
        if self.bank is not None:
            out["idle_work"] = bool(self.bank_executor and self.bank_executor.has_idle_work)  # render-ahead to run
            out["bank"] = self.bank.health()
            if self.ssd_error:  # the tier could not even be opened: RAM-only for this run
                out["bank"].update(ssd="degraded", ssd_error=self.ssd_error)
        return out

    @property
    def busy(self) -> str | None:
        """The request whose work runs now, else any admitted one; None when none is admitted."""
        current = self.scheduler.current if self.scheduler is not None else None
        if current:
            return current
        with self._lock:  # read from other threads (/health) while the engine thread admits and ends
            return next(iter(self._active), None)

    @property
    def context_window(self) -> int:
        return self.config.context_window or int(self.model_config.get("max_position_embeddings", 32768))

    @property
    def model_config(self) -> dict:
        config = self.checkpoint.config
        return config.get("text_config", config)

    @property
    def has_mtp(self) -> bool:
        return self.checkpoint.has_mtp

    # -- submission -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Submission:
        """Queue a request. Raises RequestError at once for a prompt that cannot fit."""
        if not self._ready.is_set() or self._stopping or self.died is not None:
            raise EngineStopped(f"the engine is not running{': ' + self.died if self.died else ''}")
        limit = self.context_window
        if len(request.prompt) >= limit:
            raise RequestError(f"prompt has {len(request.prompt)} tokens; the context window is {limit}")
        sub = Submission(request)
        with self._lock:
            ahead = sum(len(q) for q in self._queues.values()) + len(self._active)
        # Queued goes out before the engine thread can see the request: published after, it raced
        # the engine's own Restored event, and a listener (the receipt writer) dropped that event.
        self._publish(sub, Queued(request.request_id, ahead, request))
        with self._lock:
            self._queues.setdefault(request.session or request.request_id, deque()).append(sub)
            self._lock.notify_all()
        return sub

    def call(self, fn: Callable, timeout: float | None = None):
        """Run `fn()` on the engine thread between requests and return its result (or raise its
        error). For work that touches MLX state from outside: inspection, tests, benchmarks."""
        done: queue.Queue = queue.Queue()
        if not self.alive:
            raise EngineStopped(f"the engine is not running{': ' + self.died if self.died else ''}")
        with self._lock:
            self._queues.setdefault("__call__", deque()).append(_Call(fn, done))
            self._lock.notify_all()
        ok, value = done.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def settle(self) -> None:
        """Return once idle work (the bank's render-ahead) has run out, as it does when an agent
        spends a moment on its tools between requests."""
        while self.bank is not None and self.call(lambda: self.bank_executor.has_idle_work):
            pass

    def _next(self):
        """What the thread does next: a queued call, or the next request to admit (round-robin
        across sessions, and only while the scheduler has room); _STEP when what is admitted has
        work and nothing more can start; _IDLE when only idle work waits; None to end."""
        with self._lock:
            while not self._stopping and not self._queues and not self._stepping:
                if self.bank is not None and self.bank_executor.has_idle_work:
                    return _IDLE
                # Idle work that waits (an SSD retry back-off) wakes the thread when it is due.
                self._lock.wait(self.bank.idle_wait if self.bank is not None else None)
            if self._stopping:  # what runs finishes its cancellation; nothing new starts
                return _STEP if self._stepping else None
            if calls := self._queues.get("__call__"):
                call = calls.popleft()
                if not calls:
                    del self._queues["__call__"]
                return call
            session, pending = next(((k, q) for k, q in self._queues.items() if not self._waits(q[0])), (None, None))
            if pending is None or (self.scheduler is not None and not self.scheduler.can_admit(self._cost(pending[0].request))):
                return _STEP
            sub = pending.popleft()
            del self._queues[session]
            if pending:  # round-robin: the session goes to the back of the line
                self._queues[session] = pending
            return sub

    def _admits_more(self) -> bool:
        """Whether another request waits and the scheduler has room for it now."""
        with self._lock:
            pending = next((q for session, q in self._queues.items() if session != "__call__" and not self._waits(q[0])), None)
            return pending is not None and self.scheduler.can_admit(self._cost(pending[0].request))

    def _waits(self, sub) -> bool:
        """Whether a queued request waits for a prefilling one to pass the prompt they share
        (shared_prompt.py): once it has, the request is admitted and that prompt so far is kept
        for it (_share_running)."""
        # Not on sharded ranks: only rank 0 decides admissions, and a bank entry made on rank 0
        # alone would plan a restore the other ranks cannot follow. A scored prompt restores nothing.
        if not self.share_prompts or self.bank is None or self.scheduler is None or not isinstance(sub, Submission) \
                or self.runner.sharded or sub.request.prompt_logprobs is not None \
                or sub.cancelled.is_set():  # admitted at once, to end as cancelled (_begin)
            return False
        from mtplx.engine.shared_prompt import wait_for

        for seq in self.scheduler.prefilling:
            key = (sub.request.request_id, seq.request_id)
            if key not in self._sharing:
                self._sharing[key] = 0 if seq.cancelled() else wait_for(sub.request.prompt, seq.gen.request.prompt,
                                                                         seq.restored)
            wanted = self._sharing[key]
            if wanted > seq.shared_to and seq.restored + seq.prefilled < wanted:
                return True
        return False

    @property
    def _stepping(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work

    def _cost(self, request: GenerationRequest) -> int:
        """The KV bytes a request may come to hold (its prompt and every token it may generate)."""
        return (len(request.prompt) + request.sampling.max_tokens) * self._kv_per_token

    def _publish(self, sub: Submission, event: EngineEvent) -> None:
        # Listeners first: once a submitter sees its Finished event, the receipt is written.
        self._broadcast(event)
        sub.put(event)

    def _broadcast(self, event: EngineEvent) -> None:
        """Hand an event to every listener (bank decisions have no submission of their own)."""
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # a consumer's bug must not stop generation
                log.exception("engine listener failed on %s", type(event).__name__)

    # -- the thread -------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            from mtplx.engine.runner import ModelRunner

            self.checkpoint = self._load()
            self.runner = ModelRunner(self.checkpoint)
            self.eos_ids = set(self.checkpoint.tokenizer.eos_token_ids)
            self.draft_vocab = self._draft_vocab()
            self.runner.native_draft()  # built (once per machine) or refused now, not in the first turn
            self._start_scheduler()
            if self.bank_config is not None:
                from mtplx.bank.bank import SessionBank

                ssd = None
                if self.ssd_config is not None:
                    from mtplx.bank.ssd import SsdTier

                    try:
                        ssd = SsdTier(self.ssd_config)
                        # the ids sent-back replies render as must outlive the process like the entries they match
                        digest = hashlib.sha256(self.checkpoint.identity.encode()).hexdigest()[:12]
                        ReplyIds.of(self.checkpoint.tokenizer).persist(ssd.root / f"replies-{digest}.db")
                    except Exception as exc:  # an unusable disk costs persistence, never serving
                        self.ssd_error = f"{type(exc).__name__}: {exc}"
                        log.warning("SSD tier unavailable (%s); the bank is RAM-only", self.ssd_error)
                self.bank = SessionBank(self.checkpoint.tokenizer, self.checkpoint.identity,
                                        recurrent=self.runner.has_recurrent or self.runner.has_window,
                                        config=self.bank_config, ssd=ssd,
                                        notify=lambda action, detail: self._broadcast(BankDecision(self.busy, action, detail)))
                self.bank_executor = self._bank_executor()
        except BaseException as exc:  # reported to start(), which re-raises it on the caller's thread
            # An unexpected error while loading is still a load error: one line, exit 2 at the CLI.
            self._load_error = exc if isinstance(exc, MtplxError) or not isinstance(exc, Exception) else \
                ModelLoadError(f"{self.model_path}: could not load ({type(exc).__name__}: {exc})")
            self._ready.set()
            self._release_streams()
            return
        self._ready.set()
        try:
            while (work := self._next()) is not None:
                self._step(work)
        except BaseException as exc:  # only a bug gets here: say so everywhere, never hang a caller
            self.died = f"{type(exc).__name__}: {exc}"
            log.critical("the engine thread died: %s", self.died, exc_info=True)
            self._fail_all(f"the engine stopped: {self.died}", "internal")
        self._fail_all("the engine is shutting down", "unavailable")  # what still waits after a stop
        if self.bank is not None:  # a clean shutdown persists what is pending
            try:
                self.bank.flush()
                if self.bank.ssd is not None:
                    self.bank.ssd.close()  # frees the directory for the next server
            except Exception:
                log.exception("flushing the bank to SSD failed")
        for listener in list(self.listeners):  # a consumer that holds writes back (receipts) gets a last try
            try:
                getattr(listener, "close", lambda: None)()
            except Exception:
                log.exception("closing an engine listener failed")
        self._release_streams()

    def _load(self):
        """The checkpoint this engine runs (a sharded rank loads its part: distributed/lockstep.py)."""
        from mtplx.engine.checkpoint import load_checkpoint

        return load_checkpoint(self.model_path, self.name)

    def _draft_vocab(self):
        """The draft vocabulary learned from this model's replies, kept in $MTPLX_HOME across
        restarts; None without an MTP head, with MTPLX_DRAFT_VOCAB=off, or (auto, the default)
        where the LM head is under DRAFT_VOCAB_SHARE of a draft step, so a set saves too little."""
        from mtplx.engine.draft_vocab import DraftVocab
        from mtplx.home import home_path

        mode = os.environ.get("MTPLX_DRAFT_VOCAB", "auto").lower()
        if not self.has_mtp or self.runner.sharded or mode in ("off", "0", "false"):
            return None  # a sharded trunk's ranks keep the whole (vocab-sharded) LM head
        if mode not in ("on", "1", "true") and self.runner.lm_head_share() < DRAFT_VOCAB_SHARE:
            return None
        digest = hashlib.sha256(self.checkpoint.identity.encode()).hexdigest()[:12]
        try:
            path = home_path("draft-vocab", f"{digest}.json")
        except OSError as exc:  # an unwritable home: learned anew each run, never a failed start
            log.warning("the draft vocabulary is not kept across restarts: %s", exc)
            path = None
        vocab = DraftVocab(self.runner.vocab_rows, self.eos_ids, path)
        self.runner.use_draft_ids(vocab.ids())
        return vocab

    def _bank_executor(self):
        from mtplx.engine.bank_executor import BankExecutor

        # A request queued: render-ahead steps aside between layers (the dict read without the lock
        # is a hint; at worst one more layer runs). Calls (inspection, settle, the TUI's polls) wait
        # for the chunk: one that preempted would undo it, and a poll loop would starve the job.
        # MTPLX_RENDER_AHEAD_PREEMPT=off: chunks run whole, as before (bench/render_ahead_wait.py compares).
        whole = os.environ.get("MTPLX_RENDER_AHEAD_PREEMPT", "on").lower() in ("off", "0", "false")
        return BankExecutor(self.runner, self.bank, self.config.chunk_size,
                            waiting=None if whole else lambda: any(key != "__call__" for key in list(self._queues)))

    def _start_scheduler(self) -> None:
        import os

        from mtplx.engine.scheduler import Scheduler, kv_bytes_per_token

        itemsize = self.runner.embedding.weight.dtype.size
        self._kv_per_token = kv_bytes_per_token(self.model_config, itemsize, self.has_mtp)
        budget = self.config.memory_budget or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        self.scheduler = Scheduler(self.runner, self.config.chunk_size, self.config.max_batch, budget,
                                   lambda seq, event: self._publish(seq.sub, event), self._finish,
                                   # sharded ranks step in lockstep: no decision of theirs may hang on a clock
                                   prefill_share=1.0 if self.runner.sharded else self.config.prefill_share)

    def _step(self, work) -> None:
        """One unit of work. An exception fails at most the requests of that step or that background job."""
        if work is _IDLE:  # idle work (render-ahead, SSD writes) runs one chunk, then requests come first
            try:
                self.bank_executor.idle_step()
            except Exception as exc:
                log.exception("idle work failed; dropped")
                self.bank_executor.jobs.clear()
                self._broadcast(BankDecision(None, "idle_failed", f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(work, _Call):
            work.run()
            return
        if isinstance(work, Submission):
            with self._lock:  # active from here: a crash from now on fails it too (_fail_all)
                self._active[work.request.request_id] = work
            self.scheduler.reap_cancelled()  # an abandoned prompt's prefix is banked before this plans
            self._begin(work)
            if self._admits_more():  # a burst is admitted whole, then prefilled in one step (scheduler.step)
                return
        if self.scheduler.has_work:
            self.scheduler.step()

    def _fail_all(self, message: str, kind: str) -> None:
        with self._lock:
            waiting = [s for q in self._queues.values() for s in q]
            self._queues.clear()
            active = list(self._active.values())
            self._active.clear()
        if self.scheduler is not None:
            self.scheduler.drop_all()
        for sub in waiting + active:
            if isinstance(sub, _Call):
                sub.done.put((False, EngineStopped(message)))
            else:
                sub.put(Failed(sub.request.request_id, message, kind))

    @staticmethod
    def _release_streams() -> None:
        # MLX wants each thread to destroy its own streams before it ends; left to process
        # teardown they can abort the interpreter ("terminate called without an active exception").
        import mlx.core as mx

        mx.synchronize()
        mx.clear_streams()

    def _cancelled(self, sub: Submission) -> Callable[[], bool]:
        return lambda: sub.cancelled.is_set() or self._stopping

    # -- a request's start and end: the only places that consult the bank ------------------------
    def _begin(self, sub: Submission) -> None:
        """Admit a request: plan where it starts (the bank's restore) and hand it to the scheduler."""
        from mtplx.engine.generation import Generation, StartPoint
        from mtplx.engine.scheduler import Sequence

        request = sub.request
        self._sharing = {k: v for k, v in self._sharing.items() if k[0] != request.request_id}
        if sub.cancelled.is_set():
            with self._lock:
                self._active.pop(request.request_id, None)
            self._publish(sub, Finished(request.request_id, "cancelled", len(request.prompt), 0, 0, "", (), {}))
            return
        self.scheduler.current = request.request_id
        try:
            use_mtp = self.config.use_mtp if request.use_mtp is None else request.use_mtp
            gen = Generation(self.runner, request, use_mtp=use_mtp, depth=request.depth or self.config.depth,
                             chunk_size=self.config.chunk_size, eos_ids=self.eos_ids, submitted_at=sub.submitted_at)
            gen.stats.queued_s = time.monotonic() - sub.submitted_at  # admitted now
            seq = Sequence(sub, gen, None, self._cost(request))
            if self.bank:
                self._share_running(request)
                turn = seq.bank_turn = self.bank_executor.begin(request, gen.use_mtp)
                start, checkpoints, hook = turn.start, turn.checkpoints, turn.capture
            else:
                start, checkpoints, hook = StartPoint(), (), None
            seq.prefill = gen.prefill(start, checkpoints, hook, self._cancelled(sub))
            seq.restored = start.state.length if start.state is not None else 0
            seq.todo = len(request.prompt) - seq.restored
        except Exception as exc:
            if not isinstance(exc, RequestError):
                log.exception("request %s failed", request.request_id)
            return self._failed(sub, exc)
        self.scheduler.admit(seq)

    def _share_running(self, request: GenerationRequest) -> None:
        """A request admitted while a running turn has computed a prompt head they share (a
        second agent started while the first decodes, or while its prefill is past that head):
        that turn's prompt is kept in the bank first, so this request restores it instead of
        computing it again (bank_executor.share_running). A turn not yet past the shared head is
        waited for (_waits)."""
        if not self.share_prompts or self.runner.sharded or request.prompt_logprobs is not None:
            return
        from mtplx.engine.shared_prompt import wait_for

        # past what the bank holds for it already: what that turn restored, or was kept of it before
        shares = ((wait_for(request.prompt, s.gen.request.prompt, max(s.restored, s.shared_to)), s)
                  for s in self.scheduler.sequences if s.bank_turn is not None)
        shared, seq = max(((n, s) for n, s in shares if s.decoding or s.restored + s.prefilled >= n),
                          key=lambda pair: pair[0], default=(0, None))
        if not shared:
            return
        try:
            seq.shared_to = self.bank_executor.share_running(seq.bank_turn, seq.gen, shared, max(seq.restored, seq.shared_to),
                                                             self.scheduler.state_of(seq))
        except Exception:  # this request then computes the prompt itself; that turn goes on
            log.exception("keeping %s's prompt to share failed", seq.request_id)

    def _failed(self, sub: Submission, error: Exception) -> None:
        request_id = sub.request.request_id
        with self._lock:
            self._active.pop(request_id, None)
        if isinstance(error, RequestError):
            self._publish(sub, Failed(request_id, str(error), "invalid_request"))
        else:
            self._publish(sub, Failed(request_id, f"internal error in request {request_id}: {type(error).__name__}", "internal"))

    def _finish(self, seq, error: Exception | None) -> None:
        """A sequence ended: stop, length, cancelled (its last events, then the bank's commit),
        or an error (its Failed event)."""
        from mtplx.events import Tokens

        gen, request = seq.gen, seq.sub.request
        if error is not None:
            return self._failed(seq.sub, error)
        try:
            finished, tail = gen.finish()
            if finished.finish_reason in ("stop", "length") and not gen.stream.stopped:
                # Before the client can send the reply back (it may at once) and before the bank
                # renders the next turn's variants: both splice these ids (reply_ids.py).
                try:
                    tokenizer = self.checkpoint.tokenizer
                    reply, ids = sent_back(tokenizer, request.chat, finished.reply, finished.token_ids, request.prompt)
                    ReplyIds.of(tokenizer).record(tokenizer, reply, ids, request.prompt)
                except Exception:  # the turn was served; a reply not recorded only renders as text
                    log.exception("recording the reply ids of %s failed", request.request_id)
            if tail:
                self._publish(seq.sub, Tokens(request.request_id, (), tail, gen.segments.current))
            self._publish(seq.sub, finished)
            if self.draft_vocab is not None:
                # only what this turn added: the restored prefix was counted when it was new
                self.draft_vocab.observe_prompt(request.prompt[finished.cached_tokens:])
                if self.draft_vocab.observe(finished.token_ids):
                    self.runner.use_draft_ids(self.draft_vocab.ids())  # a new set: the next drafts use it
        finally:
            with self._lock:
                self._active.pop(request.request_id, None)
        if self.bank:
            try:
                self.bank_executor.commit(seq.bank_turn, gen, finished)
            except Exception:  # the turn was served; a failed commit only costs a future restore
                log.exception("bank commit failed for %s", request.request_id)
