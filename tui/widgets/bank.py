"""The session bank's entries, with a strip showing where each entry's anchors sit."""

from __future__ import annotations

from textual.widgets import DataTable

GLYPH = {"head": "H", "message": "M", "prompt_end": "P", "generation_end": "G", "grid": "#"}
STRIP = 28
COLUMNS = (("session", 12), ("tokens", 7), ("KiB", 7), ("hits", 5), ("anchors", STRIP))  # fixed: rows repaint in place


def anchor_strip(length: int, anchors: list[tuple[int, str]], checkpoints: list[int]) -> str:
    """A fixed-width picture of one entry: '·' tokens, '|' recurrent checkpoints, letters anchors."""
    cells = ["·"] * STRIP
    scale = lambda p: min(STRIP - 1, p * STRIP // max(length, 1))
    for p in checkpoints:
        cells[scale(p)] = "|"
    for p, kind in anchors:
        if p <= length:
            cells[scale(p)] = GLYPH.get(kind, "?")
    return "".join(cells)


class BankTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.border_title = "bank: H head  M message  P prompt end  G generation end  | checkpoint"
        for label, width in COLUMNS:
            self.add_column(label, width=width)

    def show(self, entries: list[dict]) -> None:
        self.clear()
        for e in entries:
            self.add_row(str(e["session"] or "-")[:12], str(e["tokens"]), f"{e['bytes'] / 1024:.0f}", str(e["hits"]),
                         anchor_strip(e["tokens"], e["anchors"], e["checkpoints"]))
