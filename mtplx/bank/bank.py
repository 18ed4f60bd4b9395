"""The session bank: a planner and a store. It plans where a request restores from (pure over
token lists and entry views, plan.py), keeps entries in RAM with write-through to the SSD tier,
and commits the turns the engine hands it. It never runs the model and never imports the engine:
the engine's bank_executor carries its plans out (restores caches, feeds a turn's tail, prefills
the renderings commit names in idle time).

Only the engine thread calls it. Actions are reported through the `notify` callback it is built
with: (action, detail), e.g. ("stored", "e_…: 812 tokens …").
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

from mtplx.bank.anchors import HEAD, MESSAGE, SYSTEM, Anchor, Markers, as_tokens, prompt_anchors
from mtplx.bank.entry import Entry
from mtplx.bank.folded_head import FoldedHeads
from mtplx.bank.system_end import SystemEnds
from mtplx.bank.plan import (RestorePlan, attribute_miss, common_prefix, plan_eviction, plan_restore, superseded,
                             thin_checkpoints)
from mtplx.bank.spans import message_spans, reuse_ceiling, same_reply
from mtplx.byte_size import format_size
from mtplx.vocab import token_id

log = logging.getLogger("mtplx.bank")


def default_budget() -> int:
    """A quarter of the memory free now (at least 256 MiB); 2 GiB where that cannot be read."""
    import os

    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2 << 30
    return max(256 << 20, free // 4)


@dataclass(frozen=True)
class BankConfig:
    budget_bytes: int = field(default_factory=default_budget)
    max_checkpoints: int = 8
    min_restore: int = 32
    grid: int = 1024
    render_ahead: bool = True

    def __post_init__(self):
        if self.budget_bytes <= 0 or self.max_checkpoints < 2 or self.min_restore < 1 or self.grid < 16:
            raise ValueError(f"invalid bank configuration: {self}")


@dataclass
class SsdHealth:
    """Whether the SSD tier works. A failing disk (full, read-only, removed) degrades the bank to
    RAM-only: writes wait and are retried with a growing back-off; turns never fail for it."""

    error: str | None = None
    failures: int = 0
    retry_at: float = 0.0

    def failed(self, exc: Exception) -> None:
        self.error, self.failures = f"{type(exc).__name__}: {exc}", self.failures + 1
        self.retry_at = time.monotonic() + min(300.0, 5.0 * 2 ** min(self.failures - 1, 6))

    def recovered(self) -> None:
        self.error, self.failures, self.retry_at = None, 0, 0.0

    @property
    def waiting(self) -> float:
        """Seconds until the next retry (0 when writes may run now)."""
        return max(0.0, self.retry_at - time.monotonic()) if self.error else 0.0


@dataclass
class Outcome:
    """What the bank decided for one request (for receipts and the TUI)."""

    request_id: str
    prompt_tokens: int
    ceiling: int | None
    achieved: int
    source: str
    anchor: str | None
    cause: str | None
    plan_ms: float = 0.0


@dataclass(frozen=True)
class TurnPlan:
    """The bank's plan for one prompt: where to restore from and where to capture (`restore`),
    and what the executor hands back at commit (identity, session, anchors) or reports (ceiling,
    cause, plan_ms)."""

    restore: RestorePlan
    identity: str
    session: str | None
    anchors: tuple[Anchor, ...]
    ceiling: int | None = None
    cause: str | None = None
    plan_ms: float = 0.0


@dataclass(frozen=True)
class TurnRecord:
    """What the engine hands the bank when a turn ends: its state as an entry, and the chat the
    turn answered with the reply it gave (parsed once, by the engine)."""

    entry: Entry
    chat: dict | None = None  # {"messages", "tools", "enable_thinking"} when the request was a chat
    reply: dict | None = None  # the assistant message the engine split the reply into
    sent_back: bool = False  # the client's next request carries this reply (ended by EOS or max_tokens)


def _placed(anchors: list[Anchor], anchor: Anchor) -> list[Anchor]:
    """`anchors` with `anchor` in its place (the one kind a position has: this one)."""
    return sorted([a for a in anchors if a.position != anchor.position] + [anchor], key=lambda a: a.position)


class SessionBank:
    def __init__(self, tokenizer, identity: str, *, recurrent: bool, config: BankConfig = BankConfig(), ssd=None,
                 notify: Callable[[str, str], None] = lambda action, detail: None):
        """`recurrent`: the model has layers whose state exists only at captured points (recurrent
        ones, and sliding-window ones past their window), so prefills capture it at anchors;
        `notify(action, detail)` hears every bank action."""
        self.tokenizer, self.base_identity, self.recurrent = tokenizer, identity, recurrent
        self.config, self.ssd, self.notify = config, ssd, notify
        self.markers = Markers.from_tokenizer(tokenizer)
        self.folded_heads = FoldedHeads(tokenizer)
        self.system_ends = SystemEnds(tokenizer)
        self.think_id = token_id(tokenizer, "<think>")
        self.entries: dict[str, Entry] = {}
        self.evicted: deque[tuple[int, ...]] = deque(maxlen=32)
        self.outcomes: dict[str, Outcome] = {}
        self.last_turn: dict[str, tuple[int, dict]] = {}  # session -> (messages sent, reply generated)
        self.pending_writes: deque[Entry] = deque()  # entries waiting to be persisted (idle time)
        self.writing = None  # (entry, staged write, future): a file on the I/O thread, its row not yet recorded
        self._io: ThreadPoolExecutor | None = None  # the I/O thread, started by the first write
        self.superseded: deque[str] = deque(maxlen=64)  # entry ids a longer entry replaced, latest last
        self.ssd_views = {v.entry_id: v for v in ssd.views()} if ssd is not None else {}
        self.ssd_health = SsdHealth()
        self.skipped_writes = 0  # entries too big for the SSD budget or the disk's free floor

    def identity(self, use_mtp: bool) -> str:
        return f"{self.base_identity}:{'mtp' if use_mtp else 'ar'}"

    def views(self):
        """Every entry the planner may choose: RAM first, then SSD-only ones."""
        ram = [e.view() for e in self.entries.values()]
        return ram + [v for k, v in self.ssd_views.items() if k not in self.entries]

    def summary(self) -> list[dict]:
        """Plain data about every entry (for the TUI and the API; call on the engine thread): RAM
        entries, most recently used first, then those only on SSD (after a restart, most are)."""
        ram = [{"id": e.entry_id, "session": e.session, "tokens": len(e.tokens), "bytes": e.nbytes, "hits": e.hits,
                "checkpoints": sorted(e.checkpoints), "anchors": [(a.position, a.kind) for a in e.anchors],
                "mtp": e.mtp is not None, "age_s": time.time() - e.created, "last_restore": e.last_restore,
                "origin": e.origin, "tier": "ram"}
               for e in sorted(self.entries.values(), key=lambda e: -e.last_used)]
        ssd = [{"id": v.entry_id, "session": v.session, "tokens": len(v.tokens), "bytes": v.nbytes, "hits": 0,
                "checkpoints": sorted(set(v.restorable or ()) - {len(v.tokens)}),
                "anchors": [(a.position, a.kind) for a in v.anchors], "mtp": v.mtp_len is not None, "age_s": None,
                "last_restore": None, "origin": "turn", "tier": "ssd"}
               for k, v in sorted(self.ssd_views.items(), key=lambda kv: -kv[1].last_used) if k not in self.entries]
        return ram + ssd

    def health(self) -> dict:
        """Plain data for /health and the TUI (safe to read from any thread)."""
        ssd = "off" if self.ssd is None else ("degraded" if self.ssd_health.error else "ok")
        return {"ram_entries": len(self.entries), "ram_budget_bytes": self.config.budget_bytes, "ssd": ssd,
                "ssd_error": self.ssd_health.error, "ssd_skipped": self.skipped_writes,
                # entries still in RAM (a superseded or evicted one leaves the queue only when reached)
                "pending_writes": sum(e.entry_id in self.entries for e in list(self.pending_writes))
                + (self.writing is not None)}

    # -- plan -------------------------------------------------------------------------------
    def plan(self, prompt, *, use_mtp: bool, session: str | None = None, chat: dict | None = None,
             request_id: str | None = None) -> TurnPlan:
        """Where `prompt` restores from, over the entries held now. A chat request also gets its
        reuse ceiling and, below it, the cause of the miss. Reads the store, changes nothing."""
        prompt = list(prompt)
        t0 = time.perf_counter()
        tokens = as_tokens(prompt)  # converted once; anchors and planner scan it in C
        anchors = prompt_anchors(tokens, self.markers, min_restore=self.config.min_restore, grid=self.config.grid)
        if not any(a.kind == HEAD for a in anchors):  # a template that folds the system prompt into a user turn
            head = self.folded_heads.head(chat, tokens)
            if head is not None and head >= self.config.min_restore:
                anchors = _placed(anchors, Anchor(head, HEAD))
        head = next((a.position for a in anchors if a.kind == HEAD), None)
        if head is not None and (end := self.system_ends.position(chat, tokens, head)) is not None \
                and end >= self.config.min_restore:  # the system text before the tools: kept when they change
            anchors = _placed(anchors, Anchor(end, SYSTEM))
        identity = self.identity(use_mtp)
        restore = plan_restore(tokens, anchors, self.views(), identity, need_mtp=use_mtp, recurrent=self.recurrent,
                               min_restore=self.config.min_restore)
        plan_ms = (time.perf_counter() - t0) * 1000
        # Session: the client's header, else inferred from the entry with the longest match (a
        # restore always copies state, so two clients matching one entry fork, never share).
        session = session or self._session_of(restore.entry_id) or request_id
        ceiling, cause = self._ceiling_and_cause(chat, session, prompt, restore, identity, anchors)
        return TurnPlan(restore, identity, session, tuple(anchors), ceiling, cause, plan_ms)

    def _session_of(self, entry_id: str | None) -> str | None:
        """The session of an entry in either tier (after a restart most live only on SSD)."""
        if entry_id is None:
            return None
        if entry_id in self.entries:
            return self.entries[entry_id].session
        view = self.ssd_views.get(entry_id)
        return view.session if view is not None else None

    def _ceiling_and_cause(self, chat, session, prompt, plan, identity, anchors) -> tuple[int | None, str | None]:
        if not chat:
            return None, None
        messages = chat["messages"]
        spans = message_spans(prompt, messages, self.markers)
        head = next((a.position for a in anchors if a.kind == "head"), None)
        known = None
        if (previous := self.last_turn.get(session)) is not None:
            sent, reply = previous
            known = sent + 1 if len(messages) > sent and same_reply(messages[sent], reply) else sent
        closest = None  # scanned only when needed: a follow-up turn that restores its ceiling never is
        if known is None and head is not None:
            # A session's first request: its head was knowable only if some request sent it before
            # (an entry, or one evicted since, starts with it); a head never seen is new content.
            best, evicted_match = closest = self._closest(prompt, identity)
            seen = max(common_prefix(best.tokens, prompt) if best else 0, evicted_match)
            head = head if seen >= head else None
        ceiling = reuse_ceiling(spans, known, head)
        if plan.position >= ceiling:
            return ceiling, None
        best, evicted_match = closest or self._closest(prompt, identity)
        report = attribute_miss(prompt, spans, plan.position, ceiling, best.tokens if best else None,
                                other_identity=any(v.identity != identity for v in self.views()),
                                evicted_match=evicted_match, note=plan.note, think_id=self.think_id)
        return ceiling, report.cause

    def _closest(self, prompt, identity) -> tuple:
        """The same-model entry sharing the longest prefix with `prompt`, and the longest evicted match."""
        views = [v for v in self.views() if v.identity == identity]
        best = max(views, key=lambda v: common_prefix(v.tokens, prompt), default=None)
        return best, max((common_prefix(t, prompt) for t in self.evicted), default=0)

    def record(self, outcome: Outcome) -> None:
        """What a request's restore achieved (the executor carried the plan out). The recent ones
        only: a server runs for weeks of agent turns, and the Restored event carries the same."""
        self.outcomes[outcome.request_id] = outcome
        while len(self.outcomes) > 1024:
            self.outcomes.pop(next(iter(self.outcomes)))

    # -- the store --------------------------------------------------------------------------
    def get(self, entry_id: str, identity: str) -> tuple[Entry, str]:
        """The entry and its tier: from RAM, or loaded (validated) from SSD and promoted to RAM.
        Raises if the SSD copy is damaged (the tier has then deleted it)."""
        if entry_id in self.entries:
            return self.entries[entry_id], "ram"
        entry = self.ssd.load(entry_id, identity)
        self.entries[entry_id] = entry
        self.notify("promoted", f"{entry_id}: {len(entry.tokens)} tokens from SSD to RAM")
        return entry, "ssd"

    def holds(self, tokens) -> bool:
        """Whether a RAM entry holds exactly `tokens` (its state at the end included)."""
        tokens = tuple(tokens)
        return any(e.tokens == tokens for e in self.entries.values())

    def evict(self, entry_id: str, why: str) -> None:
        """Drop an entry that failed to restore from both tiers: a damaged entry is never served."""
        self.entries.pop(entry_id, None)
        self.ssd_views.pop(entry_id, None)
        self.notify("discarded", f"{entry_id}: {why}")

    def put(self, entry: Entry) -> None:
        """Keep `entry` in RAM (thinned to the checkpoint budget, absorbing the entries it
        supersedes), queue its SSD write, and evict RAM entries over the budget."""
        pinned = {a.position for a in entry.anchors if a.kind in (HEAD, SYSTEM)}
        messages = [a.position for a in entry.anchors if a.kind == MESSAGE]
        pinned.update(messages[-2:])
        keep = thin_checkpoints(list(entry.checkpoints), self.config.max_checkpoints, pinned)
        if len(keep) < len(entry.checkpoints):
            self.notify("thinned", f"{entry.entry_id}: kept {len(keep)} of {len(entry.checkpoints)} checkpoints")
        entry.checkpoints = {p: entry.checkpoints[p] for p in keep}
        view = entry.view()
        for old_id in superseded(view, self.views()):
            old = self.entries.pop(old_id, None)
            if old is not None:
                for p, arrays in old.checkpoints.items():  # keep what the longer entry lacked
                    entry.checkpoints.setdefault(p, arrays)
            if self.ssd is not None:
                self.ssd_views.pop(old_id, None)
                self._ssd_do(lambda: self.ssd.delete(old_id), old_id)
                self.superseded.append(old_id)  # a file of it still being written gets no row
            self.notify("superseded", f"{old_id} is a prefix of {entry.entry_id}")
        self.entries[entry.entry_id] = entry
        if self.ssd is not None:
            self.pending_writes.append(entry)  # write-through, off the decode path
        self.notify("stored", f"{entry.entry_id}: {len(entry.tokens)} tokens, {entry.nbytes / 1024:.0f} KiB, "
                              f"session {entry.session}")
        ram = [e.view() for e in self.entries.values()]  # the RAM budget counts RAM entries only
        for gone in plan_eviction(ram, self.config.budget_bytes, protected={entry.entry_id}):
            dropped = self.entries.pop(gone)
            self.evicted.append(dropped.tokens)
            self.notify("evicted", f"{gone} ({len(dropped.tokens)} tokens, {dropped.nbytes / 1024:.0f} KiB) from RAM: over "
                                   f"the {self.config.budget_bytes / 2**20:.0f} MiB budget, least recently used"
                                   + (" (still on SSD)" if gone in self.ssd_views else ""))

    # -- commit -----------------------------------------------------------------------------
    def commit(self, turn: TurnRecord) -> list[list[int]]:
        """Store a turn as computed (prompt + generated tokens) and remember the reply it gave its
        session. Returns the renderings the session's next request will use (render_ahead.py),
        for the executor to prefill in idle time; none when render-ahead is off or the reply is
        not sent back as it is (cancelled, or cut by a stop string)."""
        self.put(turn.entry)
        if not turn.chat:
            return []
        session = turn.entry.session
        self.last_turn[session] = (len(turn.chat["messages"]), turn.reply)
        while len(self.last_turn) > 1024:  # only recent sessions matter for the ceiling
            self.last_turn.pop(next(iter(self.last_turn)))
        if not (self.config.render_ahead and turn.sent_back):
            return []
        from mtplx.bank.render_ahead import variants

        return variants(self.tokenizer, turn.chat, turn.reply, self.markers)

    # -- SSD writes (idle work) -------------------------------------------------------------
    # An entry's file is written on one I/O thread (SsdTier.write_file: no MLX, no SQLite), so
    # an agent's next request, sent as soon as a quick tool returns, never waits behind a write
    # of hundreds of megabytes. Staging the arrays and the manifest row stay on the engine thread.
    def persist_one(self, wait: float | None = 0.0) -> bool:
        """One step of write-through: record the write in flight once its file is done (waiting
        up to `wait` seconds for it, None: as long as it takes), else stage the next entry and
        hand its file to the I/O thread. Returns whether it did either."""
        if self.writing is not None:
            return self._finish_write(wait)
        entry = self.pending_writes.popleft()
        if entry.entry_id not in self.entries:
            return True  # superseded or evicted before its turn to be written
        staged = []
        if not self._ssd_do(lambda: staged.append(self.ssd.stage(entry)), entry.entry_id):
            self.pending_writes.appendleft(entry)  # retried after the back-off, while it is in RAM
            return True
        if not self._room_for(staged[0]):
            return True
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtplx-ssd-write")
        self.writing = (entry, staged[0], self._io.submit(self.ssd.write_file, staged[0]))
        return True

    def _room_for(self, staged) -> bool:
        """Make room for a staged file before writing it: older SSD entries go (least recently
        used) so the tier stays in budget and the disk keeps its free floor. A file that cannot
        fit even so is not written (the entry stays in RAM): a disk that is merely full is not
        a failing one, so the tier is not degraded and nothing is retried for it."""
        room = []
        if not self._ssd_do(lambda: room.append(self.ssd.make_room(staged.nbytes)), staged.entry.entry_id):
            self.pending_writes.appendleft(staged.entry)  # a failing disk: retried after the back-off
            return False
        if room[0] is None:
            free = shutil.disk_usage(self.ssd.config.root).free
            config = self.ssd.config
            why = (f"{staged.entry.entry_id}: not written to SSD: its {format_size(staged.nbytes)} would pass the "
                   f"{format_size(config.budget_bytes)} budget or leave under {format_size(config.free_floor_bytes)} "
                   f"free on the disk ({format_size(free)} free now)")
            if not self.skipped_writes:
                log.warning("%s; RAM only for such entries", why)
            self.skipped_writes += 1
            self.notify("ssd_skipped", why)
            return False
        for gone in room[0]:
            self.ssd_views.pop(gone, None)
            self.notify("evicted", f"{gone} from SSD: room for {staged.entry.entry_id}, least recently used")
        return True

    def _finish_write(self, wait: float | None) -> bool:
        entry, staged, future = self.writing
        try:
            future.exception(timeout=wait)
        except FutureTimeout:
            return False
        self.writing = None

        def record():
            size, checksum = future.result()  # the I/O thread's error, if any, is raised here
            if entry.entry_id in self.superseded:  # a longer entry replaced it while its file was written
                self.ssd.discard(staged)
                return
            # (one evicted from RAM meanwhile is kept: on SSD it still restores)
            self.ssd.record(staged, size, checksum)
            self.ssd_views[entry.entry_id] = entry.view()
            alive = {r[0] for r in self.ssd.db.execute("select entry_id from entries")}
            for gone in [k for k in self.ssd_views if k not in alive]:  # the SSD budget dropped these
                self.ssd_views.pop(gone)
                self.notify("evicted", f"{gone} from SSD: over the disk budget")

        if not self._ssd_do(record, entry.entry_id, is_write=True) and entry.entry_id in self.entries:
            self.pending_writes.appendleft(entry)  # retried after the back-off, while it is in RAM
        return True

    def _ssd_do(self, action, entry_id: str, is_write: bool = False) -> bool:
        """Run one SSD action; any failure (full or read-only disk, I/O error, a failing writer)
        degrades the tier to RAM-only instead of reaching the turn or the engine thread."""
        try:
            action()
        except Exception as exc:
            first = self.ssd_health.error is None
            self.ssd_health.failed(exc)
            if first:  # logged once per outage, not once per entry
                log.warning("SSD tier failing, bank is RAM-only until it recovers: %s", self.ssd_health.error)
            self.notify("ssd_failed", f"{entry_id}: {self.ssd_health.error}; RAM-only, retry in "
                                      f"{self.ssd_health.waiting:.0f}s")
            return False
        if self.ssd_health.error is not None and is_write:  # only a write proves the disk takes writes again
            log.warning("SSD tier recovered")
            self.notify("ssd_recovered", f"{entry_id} written; SSD tier back")
            self.ssd_health.recovered()
        return True

    def flush(self) -> None:
        """Persist every pending entry (clean shutdown): one attempt each, even while degraded."""
        if self.ssd is None:
            return
        if self.writing is not None:
            self._finish_write(None)
        for _ in range(len(self.pending_writes)):
            self.persist_one()
            if self.writing is not None:
                self._finish_write(None)
            if self.ssd_health.error:
                break  # the disk still fails: do not spend the shutdown retrying every entry
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    @property
    def writes_due(self) -> bool:
        """A file write is in flight, or entries wait to be persisted and the SSD tier is not in a
        retry back-off."""
        return self.writing is not None or bool(self.pending_writes and not self.ssd_health.waiting)

    @property
    def idle_wait(self) -> float | None:
        """How long the engine may sleep before a write is due again (None: until woken)."""
        return self.ssd_health.waiting if self.pending_writes and self.ssd_health.waiting else None
