"""Acceptance by draft depth: live for the request being decoded (from its verify events), and
summed over the turns seen so far, also by segment."""

from __future__ import annotations

from textual.widgets import Static

from mtplx.engine.segments import SEGMENTS
from mtplx.events import RequestStats

def _bar(rate: float | None, width: int) -> str:
    if rate is None:
        return "·" * width + "    -"
    filled = round(rate * width)
    return "█" * filled + "░" * (width - filled) + f" {rate:4.0%}"


class AcceptancePanel(Static):
    def on_mount(self) -> None:
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.by_segment = {s: [0, 0] for s in SEGMENTS}
        self.live_id: str | None = None
        self.live: list[list[int]] = []  # per depth: [drafted, accepted] for the running request
        self.update(self.render_text())

    def verified(self, event, show: bool = True) -> None:
        """One verify of the running request: depth i was drafted if drafted >= i, kept if accepted >= i.
        `show` False only counts it (the dashboard shows the panel later)."""
        if event.request_id != self.live_id:
            self.live_id, self.live = event.request_id, []
        while len(self.live) < event.drafted:
            self.live.append([0, 0])
        for i in range(event.drafted):
            self.live[i][0] += 1
            self.live[i][1] += int(event.accepted > i)
        if show:
            self.update(self.render_text())

    def add(self, stats: RequestStats, request_id: str | None = None) -> None:
        if request_id is not None and request_id == self.live_id:
            self.live_id = None  # its counts now live in the totals; the live lines keep them until the next
        for i, (d, a) in enumerate(zip(stats.drafted_by_depth, stats.accepted_by_depth)):
            if i >= len(self.drafted):
                self.drafted.append(0)
                self.accepted.append(0)
            self.drafted[i] += d
            self.accepted[i] += a
        for seg in SEGMENTS:
            self.by_segment[seg][0] += stats.drafted_by_segment.get(seg, 0)
            self.by_segment[seg][1] += stats.accepted_by_segment.get(seg, 0)
        self.update(self.render_text())

    def render_text(self) -> str:
        lines = []
        if self.live:
            steps = self.live[0][0]
            tau = 1 + sum(a for _, a in self.live) / steps if steps else 0
            lines.append(f"[b]{'live' if self.live_id else 'last'} request[/b] · tau {tau:.2f}")
            for i, (d, a) in enumerate(self.live):
                lines.append(f"d{i + 1} {_bar(a / d if d else None, self.bar_width(3))}")
        lines.append("[b]all turns[/b], by depth")
        if not self.drafted:
            lines.append("no drafts yet")
        for i, (d, a) in enumerate(zip(self.drafted, self.accepted)):
            lines.append(f"d{i + 1} {_bar(a / d if d else None, self.bar_width(3))}")
        lines.append("[b]by segment[/b]")
        for seg, (d, a) in self.by_segment.items():
            lines.append(f"{seg[:9]:<9} {_bar(a / d if d else None, self.bar_width(10))}")
        return "\n".join(lines)

    def bar_width(self, label: int) -> int:
        """Bars fill what the panel has (label + bar + ' 100%'), between 4 and 24 cells."""
        return max(4, min(24, (self.content_size.width or 40) - label - 5))

    def on_resize(self) -> None:
        if hasattr(self, "drafted"):
            self.update(self.render_text())
