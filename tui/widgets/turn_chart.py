"""TTFT and reuse ratio across the turns seen so far, as two one-line bar charts."""

from __future__ import annotations

from textual.widgets import Static

BLOCKS = " ▁▂▃▄▅▆▇█"


def bars(values: list[float | None], top: float, width: int) -> str:
    """The last `width` values scaled to `top`, one block glyph each ('·' where a value is missing)."""
    out = []
    for v in values[-width:]:
        if v is None:
            out.append("·")
        else:
            out.append(BLOCKS[max(1, min(8, round(8 * v / top))) if top > 0 else 1])
    return "".join(out)


class TurnChart(Static):
    """One column per turn: TTFT (scaled to the slowest shown) and ratio (achieved / ceiling, 0..1)."""

    MAX_WIDTH = 48

    @property
    def width(self) -> int:
        """Columns for bars: what the panel has after the label and the summary, up to MAX_WIDTH."""
        return max(8, min(self.MAX_WIDTH, (self.content_size.width or 70) - 20))

    def on_resize(self) -> None:
        if hasattr(self, "ttft"):
            self.update(self.render_text())

    def on_mount(self) -> None:
        self.ttft: list[float | None] = []
        self.ratio: list[float | None] = []
        self.update(self.render_text())

    def add(self, ttft: float | None, ratio: float | None) -> None:
        self.ttft.append(ttft)
        self.ratio.append(ratio)
        self.update(self.render_text())

    def render_text(self) -> str:
        if not self.ttft:
            return "TTFT  no turns yet\nratio no turns yet"
        w = self.width
        shown = [v for v in self.ttft[-w:] if v is not None]
        top = max(shown, default=0.0)
        ratios = [v for v in self.ratio[-w:] if v is not None]
        low = f"min {min(ratios):.2f}" if ratios else "no warm turn"
        return (f"TTFT  {bars(self.ttft, top, w):<{w}} max {top:.3f}s\n"
                f"ratio {bars(self.ratio, 1.0, w):<{w}} {low}")
