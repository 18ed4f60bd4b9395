"""The main screen: chat on the left; turns (table + TTFT/ratio chart), bank (entries + an anchor
map), acceptance, requests in flight and the bank's decision log on the right.

Every view here is driven by engine events as they arrive (from this chat, the endpoint, a replay
or, attached, the server's event stream) and by bank snapshots taken right after each bank event,
never by polling a finished request."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, RichLog, Static

from mtplx.events import BankDecision, DraftVerified, Failed, Finished, FirstToken, PrefillProgress, Queued, Restored, Tokens
from tui.widgets.acceptance import AcceptancePanel
from tui.widgets.anchor_map import AnchorMap
from tui.widgets.bank import BankTable
from tui.widgets.chat_panel import ChatPanel
from tui.widgets.inflight import InFlight
from tui.widgets.turn_chart import TurnChart
from tui.widgets.turns import TurnRecord, TurnTable

BANK_REFRESH_S = 0.2  # at most five bank-table repaints a second; the last snapshot always lands
KNOWN_ENTRIES = 2000


class Dashboard(Screen):
    def __init__(self, server_url: str | None, attach_url: str | None):
        super().__init__()
        self.server_url, self.attach_url = server_url, attach_url
        self.known: dict[str, dict] = {}  # every entry seen, as last seen (turns keep pointing at theirs)
        self._widgets: dict[type, object] = {}
        self._pending: list[dict] | None = None
        self._painted_at = float("-inf")

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            yield ChatPanel(bool(self.attach_url), id="left")
            with Vertical(id="right"):
                yield TurnTable(id="turns")
                yield TurnChart(id="chart")
                yield BankTable(id="bank")
                yield AnchorMap(id="anchor-map")
                with Horizontal(id="lower"):
                    yield AcceptancePanel(id="acceptance")
                    with Vertical(id="side"):
                        yield InFlight(id="inflight")
                        yield RichLog(id="log", max_lines=500, wrap=True, markup=False, min_width=20)  # wraps in a narrow box
        endpoint = (f"attached to {self.attach_url} · connecting" if self.attach_url else
                    f"endpoint {self.server_url}/v1 (OpenAI + Anthropic)" if self.server_url else "endpoint off")
        yield Static(endpoint, id="endpoint")
        yield Static("idle", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log", RichLog).border_title = "bank decisions"
        self.query_one("#turns", TurnTable).border_title = "turns (newest first; enter opens one)"
        self.set_interval(BANK_REFRESH_S, self._paint_pending)
        if not self.attach_url:
            self.query_one("#prompt").focus()

    def on_resize(self) -> None:
        # Below 120 columns the right side keeps what explains a turn (turns, chart, bank, anchor
        # map, acceptance) and drops the requests-in-flight and decision-log boxes.
        self.set_class(self.size.width < 120, "-narrow")

    # -- the bank ---------------------------------------------------------------------------
    def bank_changed(self, entries: list[dict]) -> None:
        for e in entries:
            self.known.pop(e["id"], None)
            self.known[e["id"]] = e
        while len(self.known) > KNOWN_ENTRIES:
            self.known.pop(next(iter(self.known)))
        self._pending = entries
        if time.monotonic() - self._painted_at >= BANK_REFRESH_S:
            self._paint_pending()

    def _paint_pending(self) -> None:
        if self._pending is not None:
            entries, self._pending = self._pending, None
            self._painted_at = time.monotonic()
            self.query_one(BankTable).show(entries)

    def on_bank_table_selected(self, message: BankTable.Selected) -> None:
        turns = self.query_one(TurnTable)
        if turns.has_focus and turns.selected() is not None:  # the user is reading a turn: keep its map
            self.show_turn(turns.selected())
        else:
            self.query_one(AnchorMap).show(message.entry)

    def on_turn_table_highlighted(self, message: TurnTable.Highlighted) -> None:
        # Only while the user browses turns; otherwise the map follows the bank's latest restore
        # (live, before the turn ends), which is the newest turn's own once it restored.
        if message.record is not None and self.query_one(TurnTable).has_focus:
            self.show_turn(message.record)

    def on_descendant_focus(self, event) -> None:
        turns = self.query_one(TurnTable)
        if event.widget is turns and turns.selected() is not None:
            self.show_turn(turns.selected())

    def entry_of(self, record: TurnRecord) -> dict | None:
        entry_id = record.restored.entry_id if record.restored else None
        return record.entry or (self.known.get(entry_id) if entry_id else None)

    def show_turn(self, record: TurnRecord) -> None:
        entry, r = self.entry_of(record), record.restored
        if entry is None:
            why = "computed cold" if not r or not r.cached_tokens else f"entry {r.entry_id or '?'} not seen"
            self.query_one(AnchorMap).show(None, title=f"anchor map · turn {record.number}: {why}")
        else:
            self.query_one(AnchorMap).show(entry, r.cached_tokens, f"anchor map · turn {record.number} restored "
                                                                  f"{r.cached_tokens} from {entry['id']}")

    # -- engine events ----------------------------------------------------------------------
    def handle(self, event, live: bool = False) -> None:
        """Show an engine event. `live`: one of a stream's many (the app's EventFeed); its Tokens
        and DraftVerified are only counted in the in-flight and acceptance panels, which the app
        shows a few times a second (show_live): redrawn for every batch, their layout passes
        took most of the UI thread while an agent's reply streamed."""
        if isinstance(event, BankDecision):
            self.query_one("#log", RichLog).write(f"{event.action:<10} {event.detail}")
            return
        counted = live and isinstance(event, (Tokens, DraftVerified))
        inflight, chat = self._one(InFlight), self._one(ChatPanel)
        inflight.track(event, show=not counted)
        ours = event.request_id == chat.request_id
        chat.engine_event(event)
        if counted:  # a stream's token or verify: nothing else on screen depends on it
            if isinstance(event, DraftVerified):
                self._one(AcceptancePanel).verified(event, show=False)
            return
        status = self.query_one("#status", Static)
        turns = self.query_one(TurnTable)
        if isinstance(event, Queued):
            turns.note_queued(event)
        elif isinstance(event, Restored):
            turns.note_restore(event)
            ceiling = f" of ceiling {event.ceiling}" if event.ceiling is not None else ""
            why = f" — {event.shortfall}" if event.shortfall else ""
            status.update(f"prompt {event.prompt_tokens} tokens, {event.cached_tokens} restored{ceiling} "
                          f"({event.source}{', ' + event.anchor if event.anchor else ''}){why}")
        elif isinstance(event, PrefillProgress) and ours:
            status.update(f"prefill {event.done}/{event.total}")
        elif isinstance(event, FirstToken) and ours:
            status.update(f"decode: first token after {event.ttft_s:.3f}s")
        elif isinstance(event, DraftVerified):
            self.query_one(AcceptancePanel).verified(event, show=not counted)
        elif isinstance(event, Finished):
            self.finished(event, ours, status)
        elif isinstance(event, Failed):
            self.app.notify(event.message, title="request failed", severity="error")
            status.update("failed")

    def _one(self, kind):
        """The dashboard's single widget of `kind`, looked up once: a stream's events arrive by
        the hundred a second, and each DOM query costs a selector match."""
        widget = self._widgets.get(kind)
        if widget is None:
            widget = self._widgets[kind] = self.query_one(kind)
        return widget

    def show_live(self) -> None:
        """Draw the in-flight and acceptance panels as their counts stand."""
        self._one(InFlight).refresh_view()
        acceptance = self._one(AcceptancePanel)
        acceptance.update(acceptance.render_text())

    def finished(self, event: Finished, ours: bool, status: Static) -> None:
        from mtplx.receipts.writer import client_finish

        finish = client_finish(event.finish_reason, len(event.reply.get("tool_calls", [])))
        restored = self.query_one(TurnTable).restores.get(event.request_id)
        entry = self.known.get(restored.entry_id) if restored and restored.entry_id else None
        record = self.query_one(TurnTable).add_turn(event, finish, entry)
        self.query_one(TurnChart).add(event.stats.ttft_s, record.ratio)
        self.query_one(AcceptancePanel).add(event.stats, event.request_id)
        if ours:
            status.update(f"done: {event.completion_tokens} tokens, finish {finish}")

    def connection(self, state: str) -> None:
        self.query_one("#endpoint", Static).update(f"attached to {self.attach_url} · {state}")
