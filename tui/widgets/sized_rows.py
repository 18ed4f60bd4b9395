"""Rows of text in a DataTable whose columns are exactly as wide as their widest cell.

A DataTable sizes auto-width columns when it next goes idle, and a frame drawn before that (a busy
machine) stays in its row cache at the header's widths: a table shown half laid out. Setting the
widths when the rows are set leaves nothing to the idle pass.
"""

from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import DataTable


def show_rows(table: DataTable, labels: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Replace the table's rows; the cursor row and the scroll position stay where they were
    (a replay adds a row per turn while the user may be reading further down)."""
    cursor, scroll = table.cursor_row, table.scroll_offset
    table.clear(columns=True)
    for i, label in enumerate(labels):
        table.add_column(label, width=max([cell_len(label)] + [cell_len(row[i]) for row in rows]))
    table.add_rows(rows)
    if rows and cursor > 0:
        table.move_cursor(row=min(cursor, len(rows) - 1), animate=False, scroll=False)
    if scroll.x or scroll.y:  # once the new rows are laid out, or the offset would be clamped to nothing
        table.call_after_refresh(table.scroll_to, scroll.x, scroll.y, animate=False)
