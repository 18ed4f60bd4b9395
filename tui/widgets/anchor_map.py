"""The selected bank entry drawn to scale: its anchors by kind, recurrent checkpoints, and where
the latest restore from it cut (highlighted)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tui.widgets.bank import GLYPH, ORIGIN, origin_of

STYLE = {"head": "bold magenta", "system": "bold blue", "message": "bold cyan", "prompt_end": "bold yellow", "generation_end": "bold green",
         "grid": "dim"}


def anchor_map(entry: dict, width: int, restore: int | None = None) -> Text:
    """Three lines: the bar (anchors, '|' checkpoints, the restore point reverse-highlighted), a
    scale with the entry's length and a caret under the restore point, and a summary. `restore`
    is the point to highlight (a selected turn's); without it, the entry's latest restore."""
    length = max(entry["tokens"], 1)
    scale = lambda p: min(width - 1, p * width // length)
    cells: list[tuple[str, str]] = [("─", "dim")] * width
    for p in entry["checkpoints"]:
        cells[scale(p)] = ("|", "")
    for p, kind in entry["anchors"]:
        if p <= length:
            cells[scale(p)] = (GLYPH.get(kind, "?"), STYLE.get(kind, ""))
    restore = entry.get("last_restore") if restore is None else restore
    text = Text()
    for i, (glyph, style) in enumerate(cells):
        if restore is not None and i == scale(restore):
            text.append("▼" if glyph == "─" else glyph, style="reverse bold red")
        else:
            text.append(glyph, style=style)
    # The scale line: 0, the entry's length, and a caret under the restore point (visible without
    # colour too, e.g. in a plain-text capture).
    scale_line = [" "] * width
    scale_line[0] = "0"
    end_label = str(length)
    scale_line[width - len(end_label):] = list(end_label)
    if restore is not None:  # kept clear of the two labels
        scale_line[min(max(scale(restore), 1), width - len(end_label) - 1)] = "▲"
    text.append("\n")
    for ch in scale_line:
        text.append(ch, style="reverse bold red" if ch == "▲" else "")
    where = f"restored up to {restore} (▲)" if restore is not None else "never restored"
    kind = f" ({origin_of(entry)})" if entry.get("origin") in ORIGIN else ""
    text.append(f"\n{entry['id']} {entry['session'] or '-'}{kind}: {where}; {entry['tokens']} tokens, {len(entry['anchors'])} anchors, "
                f"{len(entry['checkpoints'])} checkpoints", style="dim")
    text.no_wrap, text.overflow = True, "ellipsis"  # three lines always, however narrow
    return text


class AnchorMap(Static):
    """Draws either the entry highlighted in the bank table (its latest restore) or the entry a
    selected turn restored from (the point that turn cut at), whichever was chosen last."""

    entry: dict | None = None
    restore: int | None = None

    def on_mount(self) -> None:
        self.border_title = "anchor map (select an entry or a turn)"
        self.update("no entry selected")

    def show(self, entry: dict | None, restore: int | None = None, title: str | None = None) -> None:
        self.entry, self.restore = entry, restore
        self.border_title = title or (f"anchor map · entry {entry['id']}" if entry else "anchor map")
        self.refresh_map()

    def on_resize(self) -> None:
        self.refresh_map()

    def refresh_map(self) -> None:
        if self.entry is None:
            self.update("no entry selected")
        else:
            self.update(anchor_map(self.entry, max(self.content_size.width, 16), self.restore))
