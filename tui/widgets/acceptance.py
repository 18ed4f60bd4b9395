"""Acceptance by draft depth and by segment, summed over the turns seen so far."""

from __future__ import annotations

from textual.widgets import Static

from mtplx.engine.segments import SEGMENTS

BAR = 24


def _bar(rate: float | None) -> str:
    if rate is None:
        return "·" * BAR + "    -"
    filled = round(rate * BAR)
    return "█" * filled + "░" * (BAR - filled) + f" {rate:4.0%}"


class AcceptancePanel(Static):
    def on_mount(self) -> None:
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.by_segment = {s: [0, 0] for s in SEGMENTS}
        self.update(self.render_text())

    def add(self, stats: dict) -> None:
        for i, (d, a) in enumerate(zip(stats.get("drafted_by_depth", []), stats.get("accepted_by_depth", []))):
            if i >= len(self.drafted):
                self.drafted.append(0)
                self.accepted.append(0)
            self.drafted[i] += d
            self.accepted[i] += a
        for seg in SEGMENTS:
            self.by_segment[seg][0] += stats.get("drafted_by_segment", {}).get(seg, 0)
            self.by_segment[seg][1] += stats.get("accepted_by_segment", {}).get(seg, 0)
        self.update(self.render_text())

    def render_text(self) -> str:
        lines = ["[b]acceptance by depth[/b]"]
        if not self.drafted:
            lines.append("no drafts yet")
        for i, (d, a) in enumerate(zip(self.drafted, self.accepted)):
            lines.append(f"d{i + 1} {_bar(a / d if d else None)}")
        lines.append("[b]by segment[/b]")
        for seg, (d, a) in self.by_segment.items():
            lines.append(f"{seg[:9]:<9} {_bar(a / d if d else None)}")
        return "\n".join(lines)
