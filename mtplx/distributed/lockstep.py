"""The engine every rank runs, in lockstep: rank 0 decides, every rank does the same.

Rank 0 alone has clients (HTTP binds there). Each pass of its engine loop picks the next unit of
work as one engine does (a request to admit, a scheduler step, idle bank work, the end) and the
ranks exchange one small gather per pass: rank 0's decision, plus from every rank a digest of
what it has emitted so far (token ids, accept counts, cached tokens, finish reasons), its idle
work and its running requests. A rank whose digest differs from rank 0's has forked, and every
rank exits with one line. Idle work is of one kind per pass, agreed from every rank's state: SSD
writes (each rank its own, no collectives) or a render-ahead chunk (every rank alike). A request
admitted on rank 0 reaches the others as bytes (pickled: the
ring is private to these processes) with its sampling seed fixed, and a cancel takes effect at
the same pass on every rank: `Submission.cancel` on rank 0 only asks, the next decision applies it.

Inside a step every rank computes the same graph; the logits every rank samples from are rank 0's
(`Group.from_rank0`, in the graph: no extra host sync), so a numeric tie cannot send ranks down
different tokens or accept counts. While rank 0 waits for clients it sends a heartbeat pass every
HEARTBEAT_S, so the others' watchdog tells a lost or hung rank 0 from a quiet one.

`engine.call(fn)` runs on rank 0 only, between passes: `fn` must not run the model.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import threading
import time
import zlib
from collections import deque

from mtplx.distributed.group import Group
from mtplx.distributed.watchdog import fatal
from mtplx.engine.engine import _IDLE, _STEP, Engine, Submission, _Call
from mtplx.events import DraftVerified, Failed, Finished, Restored, Tokens

NOOP, STEP, IDLE, ADMIT, STOP = range(5)
HEARTBEAT_S = 0.5
# Each rank's bank, sent with every pass (not compared: under pp entry sizes differ per rank, and
# each rank's bank decides what it stores and evicts).
BANK_FIELDS = ("ram_entries", "ram_kib", "ssd_entries", "ssd")
SSD_STATES = ("off", "ok", "degraded")


def _bank_state(executor) -> list[int]:
    if executor is None:
        return [0, 0, 0, 0]
    bank = executor.bank
    ssd = 0 if bank.ssd is None else 2 if bank.ssd_health.error else 1
    on_ssd = sum(1 for k in bank.ssd_views if k not in bank.entries)
    return [len(bank.entries), sum(e.nbytes for e in bank.entries.values()) // 1024, on_ssd, ssd]


class AgreedCancel:
    """A Submission's cancel flag on a sharded run: `set` (any thread) asks; `is_set` turns true
    only when rank 0's decision applied it, at the same pass on every rank."""

    def __init__(self):
        self.asked = self.agreed = False

    def set(self) -> None:
        self.asked = True

    def is_set(self) -> bool:
        return self.agreed


class _Sink:
    def put(self, _event) -> None:  # a follower's requests have no reader: their events stop here
        pass


class RankEngine(Engine):
    def __init__(self, model_path, group: Group, config, name=None, bank=None, ssd=None):
        if ssd is not None:  # per-rank SSD roots: a rank's entries hold its part of the state
            layout = group.layout
            ssd = dataclasses.replace(ssd, root=ssd.root / f"{layout.mode}{layout.world}-rank{layout.rank}")
        super().__init__(model_path, config, name=name, bank=bank, ssd=ssd)
        self.group = group
        self.passes = 0
        self._digest = 0
        self._serial = 0
        self._admitted: dict[int, Submission] = {}  # serial -> an admitted, unfinished submission
        self._waiting_since: float | None = None
        self._idle_kind = "render"
        self.banks: list[list[int]] = []

    # -- loading: this rank's part, the model-wide view, rank 0's logits ------------------------
    def _load(self):
        from mtplx.distributed.shard import load_sharded

        return load_sharded(self.model_path, self.group, self.name)

    def _start_scheduler(self) -> None:
        # Plan as the whole model does, not as the layer kinds this rank holds (pipeline parallel).
        rows = self.group.gather_ints([int(self.runner.has_recurrent)], "the model-wide layer kinds")
        self.runner.has_recurrent = any(row[0] for row in rows)
        self.runner.agree = self.group.from_rank0
        super()._start_scheduler()
        if self.group.rank == 0:
            threading.Thread(target=self._heartbeat, name="mtplx-heartbeat", daemon=True).start()

    def _bank_executor(self):
        from mtplx.distributed.agreement import AgreedBankExecutor

        return AgreedBankExecutor(self.runner, self.bank, self.config.chunk_size, self.group, self._diverged)

    @property
    def layout(self) -> dict:
        return self.group.layout.describe()

    def health(self) -> dict:
        out = super().health()
        out["layout"] = {**self.layout, "passes": self.passes, **self.group.watchdog.state()}
        if self.bank_executor is not None and self.bank_executor.lowered:
            out["layout"]["restores_lowered_to_agree"] = self.bank_executor.lowered
        if self.bank_executor is not None and (banks := self.banks):  # the last pass's, read whole
            out["layout"]["banks"] = [dict(zip(BANK_FIELDS, row), rank=r, ssd=SSD_STATES[row[3]])
                                      for r, row in enumerate(banks)]
        return out

    # -- rank 0's clients --------------------------------------------------------------------
    def submit(self, request):
        if request.sampling.seed is None:  # every rank must draw the same samples
            request = dataclasses.replace(request, sampling=dataclasses.replace(
                request.sampling, seed=random.getrandbits(63)))
        with self._lock:  # re-entrant: held until the flag is swapped, so no pass sees the sub before
            self._serial += 1
            sub = super().submit(request)
            sub.serial, flag = self._serial, AgreedCancel()
            flag.asked = sub.cancelled.is_set()
            sub.cancelled = flag
        return sub

    def _cancelled(self, sub):
        return sub.cancelled.is_set  # never `_stopping` directly: a stop reaches ranks as cancels

    def _heartbeat(self) -> None:
        """Wake rank 0's idle loop every HEARTBEAT_S with a no-op call, so every rank passes."""
        while not self._stopping:
            time.sleep(HEARTBEAT_S / 2)
            waiting = self._waiting_since
            if waiting is not None and time.monotonic() - waiting >= HEARTBEAT_S:
                with self._lock:
                    if "__call__" not in self._queues:
                        self._queues["__call__"] = deque([_Call(lambda: None, _Sink())])
                        self._lock.notify_all()

    # -- the pass: rank 0 decides, every rank checks it has not forked, every rank does it -------
    def _next(self):
        try:
            return self._pass()
        except Exception as exc:
            self._diverged(f"decision {self.passes} failed ({type(exc).__name__}: {exc})")

    def _pass(self):
        payload, kind, work = b"", NOOP, None
        if self.group.rank == 0:
            self._waiting_since = time.monotonic()
            work = super()._next()
            self._waiting_since = None
            kind, payload = self._encode(work)
        cancels = self._cancels() if self.group.rank == 0 else []
        executor = self.bank_executor
        state = [self._digest, len(self._admitted), len(executor.jobs) if executor else 0]
        writes = int(executor.bank.writes_due) if executor else 0  # per rank: not compared
        rows = self.group.gather_ints([kind, len(payload), len(cancels), *state, writes, *_bank_state(executor)],
                                      f"decision {self.passes}")
        self.passes += 1
        self.banks = [row[7:] for row in rows]  # each rank's bank as of this pass (for /health, rank 0)
        kind, length, n_cancels = rows[0][:3]
        for r, row in enumerate(rows[1:], start=1):
            if row[3:6] != rows[0][3:6]:
                self._diverged(f"rank {r} forked from rank 0 at decision {self.passes} "
                               f"(digest, running, render-ahead jobs: {row[3:6]} vs {rows[0][3:6]})")
        # Idle work: SSD writes where any rank has one due (each rank its own), else render-ahead.
        self._idle_kind = "write" if any(row[6] for row in rows) else "render"
        if length or n_cancels:
            blob = pickle.dumps((payload, cancels)) if self.group.rank == 0 else None
            size = self.group.gather_ints([len(blob) if blob else 0], "the decision's size")[0][0]
            payload, cancels = pickle.loads(self.group.broadcast_bytes(blob, size, f"decision {self.passes}"))
        self._apply_cancels(cancels)
        if self.group.rank == 0:
            if kind == ADMIT:
                self._admitted[work.serial] = work
            return work
        return self._follow(kind, payload)

    def _encode(self, work):
        if work is None:
            return STOP, b""
        if work is _STEP:
            return STEP, b""
        if work is _IDLE:
            return IDLE, b""
        if isinstance(work, Submission):
            asked = work.cancelled.asked  # read once: what is sent is what rank 0 applies
            work.cancelled.agreed = asked
            return ADMIT, pickle.dumps((work.serial, work.request, asked))
        return NOOP, b""  # a call: rank 0's own business

    def _cancels(self) -> list[int]:
        return [s for s, sub in self._admitted.items() if sub.cancelled.asked and not sub.cancelled.agreed]

    def _apply_cancels(self, serials: list[int]) -> None:
        for serial in serials:
            if (sub := self._admitted.get(serial)) is not None:
                sub.cancelled.agreed = True

    def _follow(self, kind: int, payload: bytes):
        if kind == STOP:
            return None
        if kind == STEP:
            return _STEP
        if kind == IDLE:
            return _IDLE
        if kind == ADMIT:
            serial, request, asked = pickle.loads(payload)
            sub = Submission(request)
            sub.serial, sub.events, sub.cancelled = serial, _Sink(), AgreedCancel()
            sub.cancelled.asked = sub.cancelled.agreed = asked
            self._admitted[serial] = sub
            return sub
        return _Call(lambda: None, _Sink())

    def _admits_more(self) -> bool:
        # Whether to admit the next request before stepping is read from the local queue, which
        # only rank 0 has: the ranks would part ways. So here a burst is admitted one per pass.
        return False

    def _step(self, work) -> None:
        try:
            with self.group.watch(f"engine step after decision {self.passes}"):
                if work is _IDLE:  # the kind the pass agreed (Engine._step would let each rank pick)
                    self.bank_executor.idle_step(self._idle_kind)
                else:
                    super()._step(work)
        except Exception as exc:  # one engine does not go on alone: the others would wait on it
            self._diverged(f"engine step after decision {self.passes} failed ({type(exc).__name__}: {exc})")

    # -- what every rank emits, folded into the digest ----------------------------------------
    def _publish(self, sub, event) -> None:
        if isinstance(event, Tokens):
            self._fold(event.request_id, event.token_ids)
        elif isinstance(event, DraftVerified):
            self._fold(event.request_id, event.drafted, event.accepted)
        elif isinstance(event, Restored):
            self._fold(event.request_id, event.cached_tokens)
        elif isinstance(event, (Finished, Failed)):
            self._fold(event.request_id, getattr(event, "finish_reason", getattr(event, "kind", "")))
            self._admitted.pop(getattr(sub, "serial", None), None)
        super()._publish(sub, event)

    def _fold(self, *values) -> None:
        self._digest = zlib.crc32(repr(values).encode(), self._digest) & 0x7FFFFFFF

    def _diverged(self, why: str) -> None:
        fatal(self.group.rank, why)

    def follow(self) -> int:
        """A rank other than 0: run until rank 0 stops every rank; the exit status."""
        self._thread.join()
        return 0 if self.died is None else 1
