"""Past receipts from the store, newest first, filterable by any text in a row."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

COLUMNS = ("id", "utc", "source", "session", "prompt", "ceiling", "cached", "TTFT s", "tok/s", "finish", "shortfall")


class ReceiptsScreen(Screen):
    BINDINGS = [("escape", "app.pop_screen", "Back")]

    def __init__(self, store=None):
        super().__init__()
        self.store = store
        self.rows: list[dict] = []

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Input(placeholder="filter (any text in a row)", id="filter")
        yield DataTable(id="receipts", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
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
        self.fill(event.value)

    def fill(self, needle: str) -> None:
        table = self.query_one(DataTable)
        table.clear()
        f = lambda v, spec="": "-" if v is None else format(v, spec)
        for r in self.rows:
            cells = (r["id"][:14], (r["created_utc"] or "")[11:19], r["source"] or "-", (r["session"] or "-")[:14],
                     f(r["prompt_tokens"]), f(r["ceiling"]), f(r["cached_tokens"]), f(r["ttft_first_token_s"], ".3f"),
                     f(r["decode_tps"], ".1f"), r["finish_reason"] or "-", (r["shortfall"] or "")[:40])
            if needle.lower() in " ".join(cells).lower():
                table.add_row(*cells)
