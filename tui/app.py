"""`mtplx tui`: chat with the embedded engine and watch each turn's cache reuse and speculation,
while external agents use the endpoint served alongside.

The app only routes: every engine event (from any source: this chat, the endpoint, a replay)
reaches it as a message, through an engine listener or, in attach mode, the server's event
stream; bank snapshots arrive the same way. Screens and widgets turn them into pixels. Blocking
work runs in worker threads.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand

from mtplx.events import BankDecision, DraftVerified, Tokens
from tui.health import header
from tui import event_feed
from tui.messages import BankChanged, ConnectionChanged, EngineEventsWaiting, HealthChanged
from tui.screens.dashboard import Dashboard
from tui.screens.help import HelpScreen
from tui.screens.receipts import ReceiptsScreen
from tui.screens.replay import ReplayScreen

ACTIONS = (  # (action, title, help): the key bindings, the command palette and the help screen
    ("new_chat", "New chat", "Start a new conversation with a new session id (the bank keeps its entries)"),
    ("replay", "Replay a transcript", "Replay a frozen transcript turn by turn on the embedded engine"),
    ("receipts", "Browse receipts", "One row per turn from any source; enter opens one"),
    ("open_turn", "Open the selected turn", "Its receipt, raw request, restored entry and anchor map"),
    ("focus_turns", "Focus the turns table", "Arrow keys pick a turn; the anchor map shows its restore"),
    ("focus_bank", "Focus the bank table", "Arrow keys pick an entry; the anchor map draws it"),
    ("focus_chat", "Focus the chat input", "Type a message; enter sends (queued while a reply generates)"),
    ("charts", "TTFT charts", "TTFT by turn and by prompt tokens computed, with axes"),
    ("help", "Keys and panels", "Every key and what each panel shows"),
    ("quit", "Quit", "Cancel turns in flight, stop the server and the engine"),
)


class MtplxApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mtplx"
    BINDINGS = [("ctrl+q", "quit", "Quit"), ("ctrl+l", "new_chat", "New chat"), ("f2", "replay", "Replay"),
                ("f3", "receipts", "Receipts"), ("f1", "help", "Help"), ("f4", "focus_turns", "Turns"),
                ("f5", "focus_bank", "Bank"), ("f6", "focus_chat", "Chat"), ("f7", "charts", "Charts")]

    def __init__(self, engine=None, model_name: str = "", max_tokens: int = 256, server_url: str | None = None,
                 attach_url: str | None = None, receipts_store=None, api_key: str | None = None,
                 reconnect_s: float = 1.0, replay_file: Path | None = None, notice: str | None = None):
        """`notice`: a line shown once the screen is up (the endpoint moved off a taken port)."""
        super().__init__()
        self.engine, self.model_name, self.max_tokens = engine, model_name, max_tokens
        self.server_url, self.attach_url, self.receipts_store = server_url, attach_url, receipts_store
        self.api_key, self.reconnect_s, self.replay_file, self.notice = api_key, reconnect_s, replay_file, notice
        self.watch = None
        self.freeze_when_drawn = False  # `mtplx tui` sets it: see on_mount
        self.engine_feed = event_feed.EventFeed(lambda: self.post_message(EngineEventsWaiting()))
        self._live_shown, self._live_stale = 0.0, False  # when the live panels were last drawn; counts since
        self._ssd_warned = False
        self._ssd_skip_warned = False

    def on_mount(self) -> None:
        # A model that will not speculate says so in the header (no head, an unsupported family).
        notice = getattr(getattr(self.engine, "checkpoint", None), "mtp_notice", None)
        self.sub_title = (self.model_name or "no engine") + (f" · {notice}" if notice else "")
        self.dashboard = Dashboard(self.server_url, self.attach_url)
        self.push_screen(self.dashboard)
        if self.freeze_when_drawn:
            from mtplx import long_lived

            self.call_after_refresh(long_lived.freeze)
        if self.engine is not None:
            from mtplx.bank.watch import BankWatch

            self.watch = BankWatch(self.engine, lambda entries: self.post_message(BankChanged(entries)))
            self.engine.listeners += [self._from_engine, self.watch]
        if self.attach_url:
            self.follow()
        if self.replay_file is not None:
            self.action_replay()
        if self.notice:
            self.notify(self.notice, title="Port taken", severity="warning", timeout=15)

    def _from_engine(self, event) -> None:  # called on the engine thread: only hand over
        self.engine_feed.put(event)

    def on_engine_events_waiting(self, message: EngineEventsWaiting) -> None:
        """Show what the engine queued (tui/event_feed.py); if anything was, look again after the
        interval, letting the events of the rounds decoded meanwhile gather. The live panels are
        drawn at most every LIVE_PANELS seconds while only a stream's tokens and verifies come,
        and at once for anything else (a finish, a new request, a restore)."""
        events = self.engine_feed.take()
        for event in events:
            self.show_event(event, live=True)
        if events and self.is_running:  # armed until this look: the feed must be looked at again
            self.engine_feed.gathering = True
            self.set_timer(event_feed.INTERVAL, lambda: self.post_message(EngineEventsWaiting()))
        if not self.dashboard.is_attached:
            return
        now = time.monotonic()
        streaming = all(isinstance(e, (Tokens, DraftVerified)) for e in events)
        if (events or self._live_stale) and (not streaming or not events or now - self._live_shown >= event_feed.LIVE_PANELS):
            self.dashboard.show_live()
            self._live_shown, self._live_stale = now, False
        elif events:
            self._live_stale = True

    def on_unmount(self) -> None:
        if self.engine is not None:
            for listener in (self._from_engine, self.watch):
                if listener in self.engine.listeners:
                    self.engine.listeners.remove(listener)

    @property
    def chat(self):
        from tui.widgets.chat_panel import ChatPanel

        return self.dashboard.query_one(ChatPanel)

    # -- actions ----------------------------------------------------------------------------
    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for action, title, help_text in ACTIONS:
            if action != "quit":  # Textual lists its own Quit
                yield SystemCommand(title, help_text, getattr(self, f"action_{action}"))

    async def action_quit(self) -> None:
        # Turns in flight end at their next chunk or step, so the chat worker (and the engine's
        # stop after the app) never keeps the terminal blank while a long prefill runs out.
        if self.engine is not None:
            self.engine.cancel_all()
        self.exit()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_replay(self) -> None:
        if self.engine is not None:
            self.push_screen(ReplayScreen(file=self.replay_file))
        else:
            self.notify("replay needs the embedded engine (not available in attach mode)", severity="warning")

    def action_receipts(self) -> None:
        self.push_screen(ReceiptsScreen(self.receipts_store))

    def action_charts(self) -> None:
        from tui.screens.charts import ChartsScreen
        from tui.widgets.turns import TurnTable

        self.push_screen(ChartsScreen(self.dashboard.query_one(TurnTable).records))

    def action_new_chat(self) -> None:
        self.chat.new_chat()
        self.notify(f"new chat: session {self.chat.session}", timeout=3)

    def action_open_turn(self) -> None:
        from tui.widgets.turns import TurnTable

        record = self.dashboard.query_one(TurnTable).selected()
        if record is not None:
            self.open_turn(record)

    def open_turn(self, record) -> None:
        from tui.screens.turn import TurnScreen

        self.push_screen(TurnScreen.for_turn(record, self.dashboard.entry_of(record), self.receipts_store))

    def action_focus_turns(self) -> None:
        self.dashboard.query_one("#turns").focus()

    def action_focus_bank(self) -> None:
        self.dashboard.query_one("#bank").focus()

    def action_focus_chat(self) -> None:
        self.dashboard.query_one("#prompt").focus()

    # -- attach mode ------------------------------------------------------------------------
    @work(group="attach")
    async def follow(self) -> None:
        from tui.attach import Attachment

        await Attachment(self.attach_url, self.api_key, backoff_s=self.reconnect_s,
                         on_event=self.engine_feed.put,  # in batches, as the embedded engine's
                         on_bank=lambda entries: self.post_message(BankChanged(entries)),
                         on_state=lambda state: self.post_message(ConnectionChanged(state)),
                         on_health=lambda report: self.post_message(HealthChanged(report))).run()

    def on_health_changed(self, message: HealthChanged) -> None:
        # The header names the server's model and, sharded, its layout (tui/health.py).
        self.sub_title = header(self.model_name, message.report)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        if self.is_running:  # the attach worker's last messages can arrive while the app closes its screens
            self.dashboard.connection(message.state)

    # -- events -----------------------------------------------------------------------------
    def feed(self, events) -> None:
        """Deliver events as if the engine had sent them (tests, replays of recordings)."""
        for event in events:
            self.show_event(event)

    def on_bank_changed(self, message: BankChanged) -> None:
        if self.is_running:  # as on_connection_changed: a summary arriving while the app closes is dropped
            self.dashboard.bank_changed(message.entries)

    def on_turn_table_opened(self, message) -> None:
        self.open_turn(message.record)

    def show_event(self, event, live: bool = False) -> None:
        """One engine event on the dashboard (`live`: Dashboard.handle)."""
        if not self.dashboard.is_attached:  # quitting while a turn streams: no screen to show it on
            return
        if isinstance(event, BankDecision):
            if event.action == "ssd_failed" and not self._ssd_warned:  # once per outage, not per entry
                self._ssd_warned = True
                self.notify(event.detail, title="SSD tier failing: bank is RAM-only", severity="warning")
            elif event.action == "ssd_recovered":
                self._ssd_warned = False
                self.notify(event.detail, title="SSD tier recovered")
            elif event.action == "ssd_skipped" and not self._ssd_skip_warned:  # once per run
                self._ssd_skip_warned = True
                self.notify(event.detail, title="Disk too full for the SSD tier", severity="warning")
        self.dashboard.handle(event, live)
