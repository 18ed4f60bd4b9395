"""The per-turn table: prompt tokens, cached tokens, TTFT, speed, tau, finish."""

from __future__ import annotations

from textual.widgets import DataTable

from mtplx.events import Finished

from mtplx.events import Restored

COLUMNS = ("turn", "source", "prompt", "ceiling", "cached", "TTFT s", "tok/s", "tau", "mode", "finish")


class TurnTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*COLUMNS)
        self.ceilings: dict[str, int | None] = {}

    def note_restore(self, event: Restored) -> None:
        self.ceilings[event.request_id] = event.ceiling

    def add_turn(self, finished: Finished, source: str) -> None:
        s = finished.stats
        mode = f"mtp d{s['depth']}" if s.get("mode") == "mtp" else "ar"
        self.add_row(
            str(self.row_count + 1), source, str(finished.prompt_tokens),
            str(self.ceilings.get(finished.request_id) or "-"), str(finished.cached_tokens),
            f"{s['ttft_s']:.3f}" if s.get("ttft_s") is not None else "-",
            f"{s['decode_tps']:.1f}" if s.get("decode_tps") else "-",
            f"{s['tau']:.2f}" if s.get("tau") else "-", mode, finished.finish_reason,
        )
