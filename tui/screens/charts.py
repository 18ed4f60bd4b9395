"""TTFT against turn number and against prompt size, with axes, for the turns seen so far (the
dashboard's one-line sparkline shows the trend; this shows the values)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from tui.widgets.plot import plot


class ChartsScreen(Screen):
    BINDINGS = [("escape", "app.pop_screen", "Back")]

    def __init__(self, records: list):
        super().__init__()
        self.records = records

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="charts"):
            yield Static(id="ttft-by-turn")
            yield Static(id="ttft-by-prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.draw()

    def on_resize(self) -> None:
        self.draw()

    def draw(self) -> None:
        timed = [r for r in self.records if r.finished.stats.ttft_s is not None]
        by_turn = [(r.number, r.finished.stats.ttft_s) for r in timed]
        by_prompt = [(r.finished.prompt_tokens - r.finished.cached_tokens, r.finished.stats.ttft_s) for r in timed]
        for wid, points, x_title, bars in (("#ttft-by-turn", by_turn, "turn", True),
                                          ("#ttft-by-prompt", by_prompt, "prompt tokens computed (prompt - cached)",
                                           False)):
            box = self.query_one(wid, Static)
            size = box.content_size
            box.update(plot(points, size.width or 60, size.height or 20, x_title, "TTFT s", bars))
