"""The session bank's entries, with a strip showing where each entry's anchors sit."""

from __future__ import annotations

from textual.message import Message
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


def short(name: str, width: int) -> str:
    """Head and tail of a long session name (replay sessions differ only at the end)."""
    return name if len(name) <= width else name[: width // 2 - 1] + "…" + name[-(width - width // 2):]


class BankTable(DataTable):
    """Rows in most-recently-used order; the highlighted row's entry is drawn by the AnchorMap."""

    entries: list[dict] = []

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.border_title = "bank: H head  M message  P prompt end  G generation end  | checkpoint"
        for label, width in COLUMNS:
            self.add_column(label, width=width)

    def show(self, entries: list[dict]) -> None:
        keep = self.selected()
        self.entries = entries
        self.clear()
        for e in entries:
            self.add_row(short(str(e["session"] or "-"), 12), str(e["tokens"]), f"{e['bytes'] / 1024:.0f}", str(e["hits"]),
                         anchor_strip(e["tokens"], e["anchors"], e["checkpoints"]), key=e["id"])
        ids = [e["id"] for e in entries]
        if self.has_focus and keep is not None and keep["id"] in ids:  # being browsed: follow the entry
            self.move_cursor(row=ids.index(keep["id"]))
        else:  # watching: show the entry the latest restore came from (MRU order), else the newest
            self.move_cursor(row=next((i for i, e in enumerate(entries) if e.get("last_restore") is not None), 0))
        self.post_message(self.Selected(self.selected()))

    def selected(self) -> dict | None:
        if not self.entries or not (0 <= self.cursor_row < len(self.entries)):
            return None
        return self.entries[self.cursor_row]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self.post_message(self.Selected(self.selected()))

    class Selected(Message):
        """The entry the anchor map should draw (None when the bank is empty)."""

        def __init__(self, entry: dict | None) -> None:
            super().__init__()
            self.entry = entry
