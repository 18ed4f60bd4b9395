"""The session bank (RAM tier): plan a restore, capture anchors during prefill, commit turns, and
prepare the next turn's rendering in idle time.

Only the engine thread calls this. Every step is: plan (pure, plan.py) -> carry out (entry.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from mtplx.bank.anchors import GENERATION_END, MESSAGE, Anchor, Markers, as_tokens, prompt_anchors
from mtplx.bank.entry import Entry, entry_from_state, recurrent_arrays
from mtplx.bank.plan import (attribute_miss, common_prefix, plan_eviction, plan_restore, superseded,
                             thin_checkpoints)
from mtplx.bank.spans import message_spans, reuse_ceiling, same_reply
from mtplx.engine.generation import Generation, StartPoint, TurnState

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


class SessionBank:
    def __init__(self, runner, identity: str, config: BankConfig = BankConfig(), chunk_size: int = 256, ssd=None):
        self.runner, self.config, self.chunk_size, self.ssd = runner, config, chunk_size, ssd
        self.tokenizer = runner.checkpoint.tokenizer
        self.markers = Markers.from_tokenizer(self.tokenizer)
        self.think_id = self.tokenizer.get_vocab().get("<think>")
        self.base_identity = identity
        self.entries: dict[str, Entry] = {}
        self.evicted: deque[tuple[int, ...]] = deque(maxlen=32)
        self.idle: deque[Iterator] = deque()
        self.outcomes: dict[str, Outcome] = {}
        self._captures: dict[int, list] = {}
        self.last_turn: dict[str, tuple[int, dict]] = {}  # session -> (messages sent, reply generated)
        self.notify = lambda action, detail: None  # the engine points this at its listeners
        self.pending_writes: deque[Entry] = deque()  # entries waiting to be persisted (idle time)
        self.ssd_views = {v.entry_id: v for v in ssd.views()} if ssd is not None else {}
        self.ssd_health = SsdHealth()

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
                "ssd_error": self.ssd_health.error, "pending_writes": len(self.pending_writes)}

    # -- plan + restore ---------------------------------------------------------------------
    def plan(self, request, gen: Generation):
        prompt = list(request.prompt)
        t0 = time.perf_counter()
        tokens = as_tokens(prompt)  # converted once; anchors and planner scan it in C
        anchors = prompt_anchors(tokens, self.markers, min_restore=self.config.min_restore, grid=self.config.grid)
        identity = self.identity(gen.use_mtp)
        plan = plan_restore(tokens, anchors, self.views(), identity, need_mtp=gen.use_mtp,
                            recurrent=self.runner.has_recurrent, min_restore=self.config.min_restore)
        plan_ms = (time.perf_counter() - t0) * 1000
        # Session: the client's header, else inferred from the entry with the longest match (a
        # restore always copies state, so two clients matching one entry fork, never share).
        self._session = request.session or self._session_of(plan.entry_id) or request.request_id
        ceiling, cause = self._ceiling_and_cause(request, prompt, plan, identity, anchors)
        state, source = None, "cold"
        if plan.entry_id is not None:
            try:
                entry, source = self._fetch(plan.entry_id, identity)
                state = entry.restore(plan.position, prompt[plan.position])
            except Exception as exc:  # a damaged entry is dropped, never served
                log.warning("restore from %s failed (%s); computing cold", plan.entry_id, exc)
                self.entries.pop(plan.entry_id, None)
                self.ssd_views.pop(plan.entry_id, None)
                self.notify("discarded", f"{plan.entry_id}: {exc}")
                state, source, cause = None, "cold", f"restore failed, computed cold: {exc}"
        self.outcomes[request.request_id] = Outcome(request.request_id, len(prompt), ceiling,
                                                    state.length if state else 0, source, plan.anchor, cause, plan_ms)
        self._captures = {}
        self._anchors = anchors
        if state is not None:
            self.notify("restored", f"{state.length} tokens from {plan.entry_id} at {plan.anchor or 'a cut'} (plan {plan_ms:.2f} ms)")
        start = StartPoint(state, source, plan.anchor, ceiling, cause, plan.entry_id if state is not None else None)
        return start, plan.captures, self._capture

    def _session_of(self, entry_id: str | None) -> str | None:
        """The session of an entry in either tier (after a restart most live only on SSD)."""
        if entry_id is None:
            return None
        if entry_id in self.entries:
            return self.entries[entry_id].session
        view = self.ssd_views.get(entry_id)
        return view.session if view is not None else None

    def _fetch(self, entry_id: str, identity: str) -> tuple[Entry, str]:
        """The entry from RAM, or loaded (validated) from SSD and promoted to RAM."""
        if entry_id in self.entries:
            return self.entries[entry_id], "ram"
        entry = self.ssd.load(entry_id, identity)
        self.entries[entry_id] = entry
        self.notify("promoted", f"{entry_id}: {len(entry.tokens)} tokens from SSD to RAM")
        return entry, "ssd"

    def _capture(self, position: int, state: TurnState) -> None:
        self._captures[position] = recurrent_arrays(state.trunk)

    def _ceiling_and_cause(self, request, prompt, plan, identity, anchors) -> tuple[int | None, str | None]:
        chat = request.chat
        if not chat:
            return None, None
        messages = chat["messages"]
        spans = message_spans(prompt, messages, self.markers)
        head = next((a.position for a in anchors if a.kind == "head"), None)
        known = None
        if (previous := self.last_turn.get(self._session)) is not None:
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

    def _anchors_for(self, prompt):
        return prompt_anchors(prompt, self.markers, min_restore=self.config.min_restore, grid=self.config.grid)

    # -- commit -----------------------------------------------------------------------------
    def commit(self, request, gen: Generation) -> None:
        """Store the turn as computed (prompt + generated tokens), then queue the render-ahead."""
        state = gen.state
        if state is None:
            return
        if gen.prefill_cut is not None:
            return self._store_partial(gen)
        anchors = list(self._anchors)
        if gen.finish_reason == "stop" and not gen.stream.stopped:
            self._feed_to_end(gen, list(request.prompt) + gen.generated + [gen.stop_token])
            anchors.append(Anchor(state.length, GENERATION_END))
        last_hidden = gen.last_hidden_at_end
        self._store(entry_from_state(state, self.identity(gen.use_mtp), self._captures, anchors, last_hidden,
                                     self._session))
        # A reply cut by max_tokens still goes back into the client's history, so it is rendered
        # ahead too; a cancelled one, or one ended by a stop string, is not sent back as it is.
        if request.chat:
            from mtplx.chat import parse_reply

            self.last_turn[self._session] = (len(request.chat["messages"]), parse_reply(gen.stream.text))
            while len(self.last_turn) > 1024:  # only recent sessions matter for the ceiling
                self.last_turn.pop(next(iter(self.last_turn)))
        if self.config.render_ahead and request.chat and (gen.finish_reason == "length" or
                                                         (gen.finish_reason == "stop" and not gen.stream.stopped)):
            from mtplx.bank.render_ahead import variants

            for tokens in variants(self.tokenizer, request.chat, gen.stream.text, self.markers):
                self.idle.append(self._prefill_variant(tokens, gen.use_mtp, self._session))

    def _store_partial(self, gen: Generation) -> None:
        """A prefill cancelled between chunks: keep the prompt prefix it computed, so a client that
        gave up and resends (Claude Code after 300 s) restores it instead of starting over, while
        the engine was freed at once. Stored like a turn's end: the MTP head's pairs stop one short
        of the cut and the hidden state there completes the next pair on restore."""
        from mtplx.engine import cache_state

        cut, state = gen.prefill_cut, gen.state
        anchors = [a for a in self._anchors if a.position <= cut]
        entry = entry_from_state(state, self.identity(gen.use_mtp), self._captures, anchors, gen.last_hidden,
                                 self._session)
        if entry.mtp is not None:  # the last chunk's pairs reached the prompt token at `cut`
            entry.mtp = cache_state.truncate_kv([entry.mtp], cut - 1)[0]
        self._store(entry)
        self.notify("kept_partial", f"{entry.entry_id}: a cancelled prefill's first {cut} tokens")

    def _feed_to_end(self, gen: Generation, target: list[int]) -> None:
        """Feed generated tokens the decode loop sampled but never fed (the last one, EOS)."""
        state = gen.state
        if state.tokens != target[: len(state.tokens)]:
            return  # the cache went past the turn's end (a stop string): keep what was computed
        rest = target[len(state.tokens):]
        if rest:
            gen.feed_tail(rest)

    def _store(self, entry: Entry) -> None:
        pinned = {a.position for a in entry.anchors if a.kind in ("head",)}
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

    # -- render-ahead (idle work) ------------------------------------------------------------
    def _prefill_variant(self, tokens: list[int], use_mtp: bool, session: str | None) -> Iterator:
        """Compute state for the next request's rendering, one prefill chunk per step."""
        from mtplx.engine.request import GenerationRequest

        identity = self.identity(use_mtp)
        anchors = self._anchors_for(tokens)
        plan = plan_restore(tokens, anchors, self.views(), identity, need_mtp=use_mtp,
                            recurrent=self.runner.has_recurrent, min_restore=self.config.min_restore)
        if any(e.tokens == tuple(tokens) for e in self.entries.values()):
            return  # already held, state at its end included
        gen = Generation(self.runner, GenerationRequest(tuple(tokens), source="render_ahead", session=session),
                         use_mtp=use_mtp, depth=1, chunk_size=self.chunk_size, eos_ids=set(), submitted_at=time.monotonic())
        state = None
        if plan.entry_id:
            try:
                base = self._fetch(plan.entry_id, identity)[0]
                seen = base.hits, base.last_restore  # the views show the turns' restores, not this one
                state = base.restore(plan.position, tokens[plan.position])
                base.hits, base.last_restore = seen
            except Exception as exc:  # a damaged SSD entry: drop it and compute this branch cold
                self.ssd_views.pop(plan.entry_id, None)
                self.notify("discarded", f"{plan.entry_id}: {exc}")
        captures: dict[int, list] = {}
        hook = lambda p, st: captures.__setitem__(p, recurrent_arrays(st.trunk))
        for _ in gen.prefill(StartPoint(state), plan.captures, hook):
            yield
        # The whole variant is in the trunk; its last hidden completes the MTP history on restore.
        entry = entry_from_state(gen.state, identity, captures, [*anchors, Anchor(len(tokens), MESSAGE)],
                                 gen.last_hidden, session)
        entry.origin = "render_ahead"
        self._store(entry)

    def persist_one(self) -> None:
        entry = self.pending_writes.popleft()
        if entry.entry_id not in self.entries:
            return  # superseded or evicted before its turn to be written

        def write():
            self.ssd.write(entry)
            self.ssd_views[entry.entry_id] = entry.view()
            alive = {r[0] for r in self.ssd.db.execute("select entry_id from entries")}
            for gone in [k for k in self.ssd_views if k not in alive]:  # the SSD budget dropped these
                self.ssd_views.pop(gone)
                self.notify("evicted", f"{gone} from SSD: over the disk budget")

        if not self._ssd_do(write, entry.entry_id, is_write=True):
            self.pending_writes.appendleft(entry)  # retried after the back-off, while it is in RAM

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
        for _ in range(len(self.pending_writes) if self.ssd is not None else 0):
            self.persist_one()
            if self.ssd_health.error:
                break  # the disk still fails: do not spend the shutdown retrying every entry

    @property
    def has_idle_work(self) -> bool:
        return bool(self.idle or (self.pending_writes and not self.ssd_health.waiting))

    @property
    def idle_wait(self) -> float | None:
        """How long the engine may sleep before idle work is due again (None: until woken)."""
        return self.ssd_health.waiting if self.pending_writes and self.ssd_health.waiting else None

    def idle_step(self) -> bool:
        """Run one unit of idle work; returns whether any remains."""
        if self.pending_writes and not self.ssd_health.waiting:
            self.persist_one()
            return True
        while self.idle:
            try:
                next(self.idle[0])
                return True
            except StopIteration:
                self.idle.popleft()
            except Exception as exc:  # idle work is an optimisation: a failure drops it, never the engine
                log.exception("render-ahead failed")
                self.notify("render_ahead_failed", f"{type(exc).__name__}: {exc}")
                self.idle.popleft()
        return self.has_idle_work
