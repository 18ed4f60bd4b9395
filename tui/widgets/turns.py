"""The per-turn table: prompt tokens, reuse ceiling, cached tokens and ratio, TTFT, speed, tau,
where the restore came from, finish, and the cause of any shortfall."""

from __future__ import annotations

from textual.widgets import DataTable

from mtplx.bank.spans import reuse_ratio
from mtplx.events import Finished, Restored

COLUMNS = ("turn", "source", "prompt", "ceiling", "cached", "ratio", "TTFT s", "tok/s", "tau", "from", "mode", "finish",
           "shortfall")


class TurnTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*COLUMNS)
        self.restores: dict[str, Restored] = {}

    def note_restore(self, event: Restored) -> None:
        self.restores[event.request_id] = event

    def add_turn(self, finished: Finished, source: str) -> float | None:
        """Adds the row; returns the turn's reuse ratio (None for a turn with no ceiling)."""
        s = finished.stats
        restored = self.restores.pop(finished.request_id, None)
        ceiling = restored.ceiling if restored else None
        ratio = reuse_ratio(finished.cached_tokens, ceiling)
        mode = f"mtp d{s['depth']}" if s.get("mode") == "mtp" else "ar"
        self.add_row(
            str(self.row_count + 1), source, str(finished.prompt_tokens), str(ceiling or "-"),
            str(finished.cached_tokens), f"{ratio:.2f}" if ratio is not None else "-",
            f"{s['ttft_s']:.3f}" if s.get("ttft_s") is not None else "-",
            f"{s['decode_tps']:.1f}" if s.get("decode_tps") else "-",
            f"{s['tau']:.2f}" if s.get("tau") else "-", restored.source if restored else "-", mode,
            finished.finish_reason, (restored.shortfall or "") if restored else "",
        )
        self.move_cursor(row=self.row_count - 1)  # follow the newest turn
        return ratio
