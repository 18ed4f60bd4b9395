"""Replaying a frozen transcript turn by turn on the embedded engine: each turn's restore (or
miss, and why) appears as it happens."""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, ListItem, ListView, Static

from tui.widgets.sized_rows import show_rows

SAMPLES = Path(__file__).resolve().parents[2] / "sample_transcripts"
# the key numbers first (TTFT included), so they stay on screen at 80 columns
COLUMNS = ("turn", "session", "prompt", "ceil", "cached", "ratio", "TTFT s", "from", "anchor", "shortfall")


class ReplayScreen(Screen):
    BINDINGS = [("n", "next_turn", "Next turn"), ("a", "run_all", "Run all"), ("p", "toggle_pauses", "Agent pauses"),
                ("c", "compare_arms", "Compare bank on/off"), ("escape", "app.pop_screen", "Back")]
    ARMS = ("bank", "no-bank")

    def __init__(self, folder: Path = SAMPLES, file: Path | None = None):
        """`file`: one's own transcript (`mtplx tui --replay FILE`), listed first and loaded."""
        super().__init__()
        self.files = ([Path(file)] if file is not None else []) + sorted(folder.glob("*.json"))
        self.preload = file is not None
        self.transcript = None
        self.cursor = 0
        self.busy = False
        # Back to back by default, as `mtplx replay` sends turns; `p` lets render-ahead finish
        # between turns, as an agent's tool time does (`mtplx replay --pause S`).
        self.pauses = False
        self.ceilings: list[int | None] = []
        self.turn_rows: list[tuple[str, ...]] = []  # the table's rows, shown with widgets/sized_rows.py

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal():
            with Vertical(id="picker"):
                yield ListView(*[ListItem(Static(f.stem)) for f in self.files], id="files")
            with Vertical(id="replay-main"):
                yield Static("pick a transcript, then n = next turn, a = run all, p = agent pauses on/off, "
                             "c = compare bank on/off",
                             id="replay-status")
                yield DataTable(id="replay-turns", cursor_type="row")
                yield Static("", id="replay-compare")
        yield Footer()

    def on_mount(self) -> None:
        show_rows(self.query_one("#replay-turns", DataTable), COLUMNS, self.turn_rows)
        if self.preload:
            self.load(0)

    @on(ListView.Selected, "#files")
    def pick(self, event: ListView.Selected) -> None:
        self.load(event.list_view.index)

    def load(self, index: int) -> None:
        from mtplx.errors import MtplxError
        from mtplx.replay.transcript import from_export, load

        try:
            self.transcript = load(self.files[index])
        except (MtplxError, OSError, ValueError) as exc:  # one's own file: maybe a client's message export
            try:
                self.transcript = from_export(self.files[index])
            except (MtplxError, OSError, ValueError):
                self.transcript = None
                self.status(f"cannot replay {self.files[index].name}: {exc} (nor is it a list of OpenAI messages)")
                return
        self.cursor = 0
        self.ceilings = []
        self.turn_rows = []
        show_rows(self.query_one("#replay-turns", DataTable), COLUMNS, self.turn_rows)
        self.status(f"{self.transcript.name}: {len(self.transcript.turns)} turns — {self.transcript.description}")

    def status(self, text: str) -> None:
        self.query_one("#replay-status", Static).update(text)

    def action_toggle_pauses(self) -> None:
        self.pauses = not self.pauses
        self.status("between turns: " + ("agent pauses (render-ahead finishes, as mtplx replay --pause)" if self.pauses
                                         else "back to back (as mtplx replay)"))

    def action_next_turn(self) -> None:
        if self.transcript is not None and not self.busy and self.cursor < len(self.transcript.turns):
            self.busy = True
            self.send(self.cursor, 1)

    def action_run_all(self) -> None:
        if self.transcript is not None and not self.busy:
            self.busy = True
            self.send(self.cursor, len(self.transcript.turns) - self.cursor)

    @work(thread=True, exclusive=True)
    def send(self, first: int, count: int) -> None:
        from mtplx.chat import chat_request
        from mtplx.engine.sampling import SamplingParams

        from mtplx.replay.run import ceilings

        engine = self.app.engine
        if not self.ceilings:  # the reuse ceiling as `mtplx replay` defines it, so both print the same numbers
            self.ceilings = [c for _, c in ceilings(self.transcript, engine.checkpoint.tokenizer)]
        for i in range(first, first + count):
            turn = self.transcript.turns[i]
            body = turn.body
            request = chat_request(engine.checkpoint.tokenizer, body["messages"], body.get("tools"),
                                   sampling=SamplingParams(max_tokens=body.get("max_tokens", 64)),
                                   session=f"replay-{self.transcript.name}-{turn.session}", source="replay")
            restored = finished = None
            for event in engine.submit(request):
                kind = type(event).__name__
                restored = event if kind == "Restored" else restored
                finished = event if kind == "Finished" else finished
            if self.pauses:
                engine.settle()  # an agent's tool time: render-ahead completes before the next turn
            self.app.call_from_thread(self.add_turn, i, turn.session, restored, finished, self.ceilings[i])
        self.busy = False

    def action_compare_arms(self) -> None:
        if self.transcript is not None and not self.busy:
            self.busy = True
            self.status(f"{self.transcript.name}: replaying under arms {' and '.join(self.ARMS)} (fresh engine each)…")
            self.compare_arms(self.files[self.query_one("#files", ListView).index or 0])

    @work(thread=True, exclusive=True)
    def compare_arms(self, path: Path) -> None:
        """The transcript under two arms, each on a fresh engine and bank (as `mtplx replay --arm`
        does), then the per-turn compare: cached tokens, TTFT, output parity."""
        from mtplx.errors import MtplxError
        from mtplx.replay.session import compare_files, run_replay

        try:
            paths = run_replay(path, None, self.app.model_name or "tiny-dense", list(self.ARMS), 1, None,
                               echo=lambda line: self.app.call_from_thread(self.status, line))
            table, parity = compare_files(paths[0], paths[1])
            verdict = "outputs identical" if parity else "OUTPUTS DIFFER"
            text = f"A = {self.ARMS[0]}, B = {self.ARMS[1]} — {verdict}\n{table}"
        except MtplxError as exc:
            text = f"compare failed: {exc}"
        self.app.call_from_thread(self.query_one("#replay-compare", Static).update, text)
        self.app.call_from_thread(self.status, f"{self.transcript.name}: arms compared")
        self.busy = False

    def add_turn(self, i: int, session: str, restored, finished, ceiling: int | None) -> None:
        from mtplx.receipts.report import ratio_text

        self.cursor = i + 1
        if i == 0 and restored is not None and restored.cached_tokens:
            # `mtplx replay` rejects a warm first turn; here it is shown, and said, not hidden
            self.app.notify(f"the bank is warm: turn 0 restored {restored.cached_tokens} tokens, so these numbers "
                            "differ from a cold `mtplx replay`; c replays on fresh engines", title="warm bank",
                            severity="warning", timeout=8)
        f = lambda v, spec="": "-" if v is None else format(v, spec)
        self.turn_rows.append((
            str(i), session, f(restored.prompt_tokens), f(ceiling), f(restored.cached_tokens),
            ratio_text(restored.cached_tokens, ceiling),
            f(finished.stats.ttft_s if finished else None, ".3f"), restored.source, restored.anchor or "-",
            # the bank explains a miss against its own ceiling; shown only when this ceiling was missed too
            (restored.shortfall or "") if ceiling is not None and restored.cached_tokens < ceiling else ""))
        show_rows(self.query_one("#replay-turns", DataTable), COLUMNS, self.turn_rows)
        self.status(f"{self.transcript.name}: turn {self.cursor}/{len(self.transcript.turns)} done")
