"""The engine thread: the one thread that owns every MLX array.

Callers `submit` a GenerationRequest and read its events from the returned Submission (a
queue); `cancel` sets a flag the step loop checks every step. Requests wait in one queue per
session and sessions are served round-robin, so one agent's burst cannot starve another.
Every event is also handed to the engine's listeners (receipt writer, metrics, TUI), which must
return quickly.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("mtplx.engine")


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 256
    use_mtp: bool = True
    depth: int = 2
    context_window: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self):
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 16):
            raise ValueError(f"chunk_size must be an integer >= 16, got {self.chunk_size!r}")
        if not (isinstance(self.depth, int) and 1 <= self.depth <= 4):
            raise ValueError(f"depth must be in 1..4, got {self.depth!r}")


class Submission:
    """A submitted request: iterate it for its events (ends after Finished or Failed)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue[EngineEvent] = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()

    def cancel(self) -> None:
        self.cancelled.set()

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


_IDLE = object()  # _next's answer when no request waits but idle work does


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
        self.checkpoint = self.runner = None
        self.busy: str | None = None  # request id being served
        self._current: Submission | None = None
        self.died: str | None = None  # why the engine thread ended unexpectedly (None while healthy)
        self.ssd_error: str | None = None  # why the SSD tier could not be opened, if it could not

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
            waiting = [s for q in self._queues.values() for s in q if isinstance(s, Submission)]
            current = self._current
        for sub in waiting + ([current] if current is not None else []):
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
        if self.bank is not None:
            out["bank"] = self.bank.health()
            if self.ssd_error:  # the tier could not even be opened: RAM-only for this run
                out["bank"].update(ssd="degraded", ssd_error=self.ssd_error)
        return out

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
            session = request.session or request.request_id
            self._queues.setdefault(session, deque()).append(sub)
            ahead = sum(len(q) for q in self._queues.values()) - 1 + (1 if self.busy else 0)
            self._lock.notify_all()
        self._publish(sub, Queued(request.request_id, ahead, request))
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

    def _next(self) -> Submission | None:
        with self._lock:
            while not self._stopping and not self._queues:
                if self.bank is not None and self.bank_executor.has_idle_work:
                    return _IDLE
                # Idle work that waits (an SSD retry back-off) wakes the thread when it is due.
                self._lock.wait(self.bank.idle_wait if self.bank is not None else None)
            if self._stopping:
                return None
            session, pending = next(iter(self._queues.items()))
            sub = pending.popleft()
            del self._queues[session]
            if pending:  # round-robin: the session goes to the back of the line
                self._queues[session] = pending
            return sub

    def _publish(self, sub: Submission, event: EngineEvent) -> None:
        # Listeners first: once a submitter sees its Finished event, the receipt is written.
        self._broadcast(event)
        sub.events.put(event)

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
            from mtplx.engine.checkpoint import load_checkpoint
            from mtplx.engine.runner import ModelRunner

            self.checkpoint = load_checkpoint(self.model_path, self.name)
            self.runner = ModelRunner(self.checkpoint)
            self.eos_ids = set(self.checkpoint.tokenizer.eos_token_ids)
            if self.bank_config is not None:
                from mtplx.bank.bank import SessionBank
                from mtplx.engine.bank_executor import BankExecutor

                ssd = None
                if self.ssd_config is not None:
                    from mtplx.bank.ssd import SsdTier

                    try:
                        ssd = SsdTier(self.ssd_config)
                    except Exception as exc:  # an unusable disk costs persistence, never serving
                        self.ssd_error = f"{type(exc).__name__}: {exc}"
                        log.warning("SSD tier unavailable (%s); the bank is RAM-only", self.ssd_error)
                self.bank = SessionBank(self.checkpoint.tokenizer, self.checkpoint.identity,
                                        recurrent=self.runner.has_recurrent, config=self.bank_config, ssd=ssd,
                                        notify=lambda action, detail: self._broadcast(BankDecision(self.busy, action, detail)))
                self.bank_executor = BankExecutor(self.runner, self.bank, self.config.chunk_size)
        except BaseException as exc:  # reported to start(), which re-raises it on the caller's thread
            # An unexpected error while loading is still a load error: one line, exit 2 at the CLI.
            self._load_error = exc if isinstance(exc, MtplxError) or not isinstance(exc, Exception) else \
                ModelLoadError(f"{self.model_path}: could not load ({type(exc).__name__}: {exc})")
            self._ready.set()
            self._release_streams()
            return
        self._ready.set()
        try:
            while (sub := self._next()) is not None:
                self._step(sub)
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
        self._release_streams()

    def _step(self, sub) -> None:
        """One unit of work. An exception fails at most that request or that background job."""
        if sub is _IDLE:  # idle work (render-ahead, SSD writes) runs one chunk, then requests come first
            try:
                self.bank_executor.idle_step()
            except Exception as exc:
                log.exception("idle work failed; dropped")
                self.bank_executor.jobs.clear()
                self._broadcast(BankDecision(None, "idle_failed", f"{type(exc).__name__}: {exc}"))
            return
        if isinstance(sub, _Call):
            sub.run()
            return
        self.busy, self._current = sub.request.request_id, sub
        self._serve(sub)  # catches every Exception; what escapes kills the thread and _fail_all needs _current
        self.busy, self._current = None, None

    def _fail_all(self, message: str, kind: str) -> None:
        with self._lock:
            waiting = [s for q in self._queues.values() for s in q]
            self._queues.clear()
        current = self._current
        for sub in waiting + ([current] if current is not None else []):
            if isinstance(sub, _Call):
                sub.done.put((False, EngineStopped(message)))
            else:
                sub.events.put(Failed(sub.request.request_id, message, kind))

    @staticmethod
    def _release_streams() -> None:
        # MLX wants each thread to destroy its own streams before it ends; left to process
        # teardown they can abort the interpreter ("terminate called without an active exception").
        import mlx.core as mx

        mx.synchronize()
        mx.clear_streams()

    def _cancelled(self, sub: Submission) -> Callable[[], bool]:
        return lambda: sub.cancelled.is_set() or self._stopping

    def _serve(self, sub: Submission) -> None:
        from mtplx.engine.generation import Generation, StartPoint, events

        request = sub.request
        if sub.cancelled.is_set():
            self._publish(sub, Finished(request.request_id, "cancelled", len(request.prompt), 0, 0, "", (), {}))
            return
        try:
            use_mtp = self.config.use_mtp if request.use_mtp is None else request.use_mtp
            gen = Generation(self.runner, request, use_mtp=use_mtp, depth=request.depth or self.config.depth,
                             chunk_size=self.config.chunk_size, eos_ids=self.eos_ids, submitted_at=sub.submitted_at)
            banked = self.bank_executor.begin(request, gen.use_mtp) if self.bank else None
            start, checkpoints, hook = (banked.start, banked.checkpoints, banked.capture) if banked else (StartPoint(), (), None)
            for event in events(gen, start, self._cancelled(sub), checkpoints, hook):
                self._publish(sub, event)
            if banked:
                try:
                    self.bank_executor.commit(banked, gen, event)
                except Exception:  # the turn was served; a failed commit only costs a future restore
                    log.exception("bank commit failed for %s", request.request_id)
        except RequestError as exc:
            self._publish(sub, Failed(request.request_id, str(exc), "invalid_request"))
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            self._publish(sub, Failed(request.request_id, f"internal error in request {request.request_id}: {type(exc).__name__}", "internal"))
