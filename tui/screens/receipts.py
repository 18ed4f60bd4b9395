"""Past receipts from the store, newest first, filterable by any text in a row; enter opens one
(its numbers, raw request and, when this session saw it, the entry it restored from)."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

from mtplx.receipts.report import ratio_text
from tui.widgets.sized_rows import show_rows

# the key numbers first, so TTFT stays on screen at 80 columns; the id (for `receipts show`) last
COLUMNS = ("utc", "session", "src", "prompt", "ceil", "cached", "ratio", "TTFT s", "tok/s", "finish", "id", "shortfall")


def cells(r: dict) -> tuple[str, ...]:
    f = lambda v, spec="": "-" if v is None else format(v, spec)
    ratio = ratio_text(r.get("cached_tokens"), r.get("ceiling"))
    return ((r["created_utc"] or "")[11:19], (r["session"] or "-")[:10], (r["source"] or "-")[:6], f(r["prompt_tokens"]),
            f(r["ceiling"]), f(r["cached_tokens"]), ratio, f(r["ttft_first_token_s"], ".3f"),
            f(r["decode_tps"], ".1f"), r["finish_reason"] or "-", r["id"][:14], (r["shortfall"] or "")[:40])


class ReceiptsScreen(Screen):
    BINDINGS = [("escape", "app.pop_screen", "Back")]

    def __init__(self, store=None):
        super().__init__()
        self.store = store
        self.rows: list[dict] = []
        self.shown: list[dict] = []
        self.needle = ""

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Input(placeholder="filter (any text in a row); enter on a row opens it", id="filter")
        yield DataTable(id="receipts", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.fill("")  # the header while the rows load
        self.query_one(DataTable).focus()
        self.load()

    @work(thread=True)
    def load(self) -> None:
        from mtplx.receipts.store import ReceiptStore

        rows = (self.store or ReceiptStore()).rows()[-500:][::-1]
        self.app.call_from_thread(self.show, rows)

    def show(self, rows: list[dict]) -> None:
        self.rows = rows
        self.fill("")

    @on(Input.Changed, "#filter")
    def refilter(self, event: Input.Changed) -> None:
        if event.value != self.needle:  # an unchanged filter (the input's first event) keeps the table as it is
            self.fill(event.value)

    def fill(self, needle: str) -> None:
        """The rows matching `needle` (widths set with the rows: widgets/sized_rows.py)."""
        self.needle = needle
        self.shown, shown_cells = [], []
        for r in self.rows:
            row = cells(r)
            if needle.lower() in " ".join(row).lower():
                shown_cells.append(row)
                self.shown.append(r)
        show_rows(self.query_one(DataTable), COLUMNS, shown_cells)

    @on(DataTable.RowSelected, "#receipts")
    def open_row(self, event: DataTable.RowSelected) -> None:
        from tui.screens.turn import TurnScreen

        if 0 <= event.cursor_row < len(self.shown):
            row = self.shown[event.cursor_row]
            known = getattr(getattr(self.app, "dashboard", None), "known", {})
            self.app.push_screen(TurnScreen.for_receipt(row, known.get(row.get("entry_id") or "")))
