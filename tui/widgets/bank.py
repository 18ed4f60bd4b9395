"""The session bank's entries, with a strip showing where each entry's anchors sit. Entries a
render-ahead prepared (the next turn's expected rendering) are labelled "ahead"."""

from __future__ import annotations

from textual.message import Message
from textual.widgets import DataTable

GLYPH = {"head": "H", "system": "S", "message": "M", "prompt_end": "P", "generation_end": "G", "grid": "#"}
# (key, label, width, priority: lower survives longer); the anchor strip takes what is left
COLUMNS = (("session", "session", 10, 0), ("origin", "from", 5, 0), ("tokens", "tokens", 6, 1), ("hits", "hits", 4, 2),
           ("kib", "KiB", 6, 3))
MIN_STRIP, MAX_STRIP = 12, 40


def anchor_strip(length: int, anchors: list[tuple[int, str]], checkpoints: list[int], width: int = 28) -> str:
    """A fixed-width picture of one entry: '·' tokens, '|' recurrent checkpoints, letters anchors."""
    cells = ["·"] * width
    scale = lambda p: min(width - 1, p * width // max(length, 1))
    for p in checkpoints:
        cells[scale(p)] = "|"
    for p, kind in anchors:
        if p <= length:
            cells[scale(p)] = GLYPH.get(kind, "?")
    return "".join(cells)


# What made an entry, by its origin (mtplx/bank/entry.py): its own turn, idle-time render-ahead,
# or a prompt prefix kept for turns that share it with one still running (mtplx/engine/shared_prompt.py).
ORIGIN = {"render_ahead": ("ahead", "render-ahead"), "shared_prompt": ("share", "a shared prompt")}


def origin_of(entry: dict) -> str:
    """The entry's origin in words ("a turn" unless it came from render-ahead or a shared prompt)."""
    return made_by(entry.get("origin"))


def made_by(origin: str | None) -> str:
    """An entry origin (Entry.origin, a receipt's entry_origin) in words."""
    return ORIGIN.get(origin, (None, "a turn"))[1]


def short(name: str, width: int) -> str:
    """Head and tail of a long session name (replay sessions differ only at the end)."""
    return name if len(name) <= width else name[: width // 2 - 1] + "…" + name[-(width - width // 2):]


def layout(width: int) -> tuple[list[str], int]:
    """The columns that fit beside an anchor strip of at least MIN_STRIP cells, and the strip's width."""
    keys, used = [], MIN_STRIP + 2
    for key, _, w, _ in sorted(COLUMNS, key=lambda c: c[3]):
        if used + w + 2 <= width:
            keys.append(key)
            used += w + 2
    strip = max(MIN_STRIP, min(MAX_STRIP, width - used + MIN_STRIP))
    return [c[0] for c in COLUMNS if c[0] in keys], strip


class BankTable(DataTable):
    """Rows in most-recently-used order; the highlighted row's entry is drawn by the AnchorMap."""

    entries: list[dict] = []

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.border_title = "bank: H head  S system  M message  P prompt end  G generation end  | checkpoint"
        self.shape: tuple[list[str], int] | None = None
        self.show([])

    def show(self, entries: list[dict]) -> None:
        keep = self.selected()
        self.entries = entries
        shape = layout(self.content_size.width or self.size.width or 80)
        if shape != self.shape:
            self.shape = shape
            self.clear(columns=True)
            for key, label, w, _ in COLUMNS:
                if key in shape[0]:
                    self.add_column(label, width=w, key=key)
            self.add_column("anchors", width=shape[1], key="anchors")
        else:
            self.clear()
        for e in entries:
            cells = {"session": short(str(e["session"] or "-"), 10),
                     "origin": (ORIGIN[e["origin"]][0] if e.get("origin") in ORIGIN else
                                "ssd" if e.get("tier") == "ssd" else "turn"),  # ssd: on disk only, not in RAM
                     "tokens": str(e["tokens"]), "hits": str(e["hits"]), "kib": f"{e['bytes'] / 1024:.0f}"}
            self.add_row(*(cells[k] for k in self.shape[0]),
                         anchor_strip(e["tokens"], e["anchors"], e["checkpoints"], self.shape[1]), key=e["id"])
        ids = [e["id"] for e in entries]
        if self.has_focus and keep is not None and keep["id"] in ids:  # being browsed: follow the entry
            self.move_cursor(row=ids.index(keep["id"]))
        else:  # watching: show the entry the latest restore came from (MRU order), else the newest
            self.move_cursor(row=next((i for i, e in enumerate(entries) if e.get("last_restore") is not None), 0))
        self.post_message(self.Selected(self.selected()))

    def on_resize(self) -> None:
        if hasattr(self, "shape") and layout(self.content_size.width) != self.shape:
            self.show(self.entries)

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
