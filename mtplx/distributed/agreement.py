"""The bank's restore point agreed across ranks: the minimum over ranks, for requests and for
render-ahead alike.

Every rank plans from the same inputs (the same requests in the same order, the model-wide
recurrent flag), yet plans can differ: under pipeline parallelism a rank holding only attention
layers can cut its entries anywhere, while a rank holding GatedDeltaNet layers restores only at
captured checkpoints (seen at 4 ranks: 82 vs 59 tokens), and a rank's own tiers may have lost an
entry (an unreadable SSD file, an eviction: entries differ in size per rank). So every plan is
exchanged: where the ranks disagree, each takes the minimum position and the capture positions
planned by the rank that chose it (captures set the prefill's chunk boundaries, which every rank
must run alike). After the restore itself the ranks compare what they restored again; a rank
above the minimum restores again there, or every rank starts cold. A render-ahead is skipped only
when every rank holds its rendering, and the RAM budget is the smallest rank's.

Not agreed: which entries each rank stores, thins or evicts (each rank's bank decides from its
own entries, whose sizes differ under pipeline parallelism); only their consequences for the
forward passes above are. A rank that evicted more restores less, and every rank with it.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib

from mtplx.bank.plan import RestorePlan
from mtplx.engine.bank_executor import WRITE_POLL_S, BankExecutor, BankedTurn, restore
from mtplx.state.turn import StartPoint

log = logging.getLogger("mtplx.distributed")


def _crc(value) -> int:
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


class AgreedPlans:
    """The bank as the executor sees it: the same, except that `plan` is agreed across ranks."""

    def __init__(self, bank, group, on_lowered):
        self._bank, self._group, self._on_lowered = bank, group, on_lowered
        self.hold_writes = False  # set while a pass runs render-ahead only (AgreedBankExecutor.idle_step)

    def __getattr__(self, name):
        return getattr(self._bank, name)

    @property
    def writes_due(self) -> bool:
        return not self.hold_writes and self._bank.writes_due

    def holds(self, tokens) -> bool:
        """Whether every rank holds `tokens` (a render-ahead runs on all ranks or on none)."""
        rows = self._group.gather_ints([int(self._bank.holds(tokens))], "whether the bank holds a rendering")
        return all(row[0] for row in rows)

    def plan(self, prompt, **kwargs):
        plan = self._bank.plan(prompt, **kwargs)
        mine = plan.restore
        rows = self._group.gather_ints([mine.position, len(mine.captures), _crc(mine.captures)], "a restore plan")
        if all(row == rows[0] for row in rows):
            return plan
        low = min(range(len(rows)), key=lambda r: rows[r][0])
        width = max(row[1] for row in rows)
        padded = list(mine.captures) + [-1] * (width - len(mine.captures))
        captures = tuple(c for c in self._group.gather_ints(padded, "the agreed capture positions")[low] if c >= 0) \
            if width else ()
        position = rows[low][0]
        if position != mine.position:
            self._on_lowered()
        kind = next((a.kind for a in plan.anchors if a.position == position), "checkpoint") if position else None
        agreed = RestorePlan(mine.entry_id if position else None, position, kind, mine.match, captures,
                             f"agreed with the other ranks at {position} (this rank could restore {mine.position})")
        return dataclasses.replace(plan, restore=agreed)


class AgreedBankExecutor(BankExecutor):
    def __init__(self, runner, bank, chunk_size: int, group, on_divergence):
        self.lowered = 0  # plans or restores this rank lowered to agree with the others (for /health)
        # One RAM budget for all: the smallest rank's (ranks sharing a machine each saw its free memory).
        budgets = group.gather_ints([min(bank.config.budget_bytes >> 20, 2**31 - 1)], "the bank's RAM budget")
        bank.config = dataclasses.replace(bank.config, budget_bytes=min(row[0] for row in budgets) << 20)
        super().__init__(runner, AgreedPlans(bank, group, self._lowered), chunk_size)
        self.group, self.on_divergence = group, on_divergence

    def _lowered(self) -> None:
        self.lowered += 1

    def idle_step(self, kind: str = "render") -> bool:
        """One unit of idle work of the kind the pass agreed: "write" persists one entry where this
        rank has one due (no collectives: each rank's own disk, its own retry back-off); "render"
        advances the render-ahead, which every rank must run alike, holding this rank's writes."""
        if kind == "write":
            if self.bank.writes_due:
                self.bank.persist_one(wait=WRITE_POLL_S)  # a file in flight: a moment's wait, not a spin of passes
            return self.has_idle_work
        self.bank.hold_writes = True
        try:
            return super().idle_step()
        finally:
            self.bank.hold_writes = False

    def begin(self, request, use_mtp: bool) -> BankedTurn:
        turn = super().begin(request, use_mtp)
        rows = self.group.gather_ints([turn.start.cached, _crc(turn.checkpoints)], f"the restore point of {request.request_id}")
        if len({row[1] for row in rows}) > 1:
            self.on_divergence(f"ranks planned different capture positions for {request.request_id}")
        agreed = min(row[0] for row in rows)
        if agreed != turn.start.cached:
            self.lowered += 1
            turn.start = self._lower(turn, agreed)
            rows = self.group.gather_ints([turn.start.cached], f"the lowered restore point of {request.request_id}")
            if len({row[0] for row in rows}) > 1:  # some rank could not restore at the minimum: all go cold
                turn.start = self._lower(turn, 0)
        return turn

    def _lower(self, turn: BankedTurn, position: int) -> StartPoint:
        start = turn.start
        why = f"restored {position} of {start.cached} tokens to agree with the other ranks"
        if position > 0 and start.entry_id is not None:
            try:
                entry, _ = self.bank.get(start.entry_id, turn.plan.identity)
                if not entry.recurrent or position == len(entry.tokens) or position in entry.checkpoints:
                    return dataclasses.replace(start, state=restore(entry, position), shortfall=why)
            except Exception as exc:  # a damaged entry: cold, like any failed restore
                log.warning("restore from %s at %d failed (%s)", start.entry_id, position, exc)
        return StartPoint(source="cold", ceiling=start.ceiling, shortfall=why if position == 0 else
                          f"computed cold: this rank could not restore at the other ranks' {position} tokens")
