"""`mtplx tui`: chat with the embedded engine and watch each turn's cache reuse and speculation,
while external agents use the endpoint served alongside.

The app only routes: every engine event (from any source: this chat, the endpoint, a replay)
reaches it as a message, through an engine listener or, in attach mode, the server's event
stream; widgets turn them into pixels. Blocking work runs in worker threads.
"""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import App
from textual.widgets import Input, RichLog, Static

from mtplx.errors import MtplxError
from mtplx.events import BankDecision, DraftVerified, Failed, Finished, FirstToken, PrefillProgress, Queued, Restored, Tokens
from tui.messages import BankChanged, EngineEventArrived
from tui.screens.dashboard import Dashboard
from tui.screens.help import HelpScreen
from tui.screens.receipts import ReceiptsScreen
from tui.screens.replay import ReplayScreen
from tui.widgets.acceptance import AcceptancePanel
from tui.widgets.bank import BankTable
from tui.widgets.chat import ChatView
from tui.widgets.inflight import InFlight
from tui.widgets.turn_chart import TurnChart
from tui.widgets.turns import TurnTable

SYSTEM = "You are a careful coding agent. Think before you act."


class MtplxApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mtplx"
    BINDINGS = [("ctrl+q", "quit", "Quit"), ("ctrl+l", "clear", "New chat"), ("f2", "replay", "Replay"),
                ("f3", "receipts", "Receipts"), ("f1", "help", "Help"), ("question_mark", "help", "Help")]

    def __init__(self, engine=None, model_name: str = "", max_tokens: int = 256, server_url: str | None = None,
                 attach_url: str | None = None, receipts_store=None):
        super().__init__()
        self.engine, self.model_name, self.max_tokens = engine, model_name, max_tokens
        self.server_url, self.attach_url, self.receipts_store = server_url, attach_url, receipts_store
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        self.sources: dict[str, str] = {}
        self.chat_request: str | None = None
        self._ssd_warned = False

    def on_mount(self) -> None:
        # A model that will not speculate says so in the header (no head, an unsupported family).
        notice = getattr(getattr(self.engine, "checkpoint", None), "mtp_notice", None)
        self.sub_title = (self.model_name or "no engine") + (f" · {notice}" if notice else "")
        self.dashboard = Dashboard(self.server_url, self.attach_url)
        self.push_screen(self.dashboard)
        if self.engine is not None:
            self.engine.listeners.append(self._from_engine)
        if self.attach_url:
            self.follow(self.attach_url)

    def _from_engine(self, event) -> None:  # called on the engine thread: only hand over
        self.post_message(EngineEventArrived(event))

    def on_unmount(self) -> None:
        if self.engine is not None and self._from_engine in self.engine.listeners:
            self.engine.listeners.remove(self._from_engine)

    # -- actions ----------------------------------------------------------------------------
    async def action_quit(self) -> None:
        # Turns in flight end at their next chunk or step, so the chat worker (and the engine's
        # stop after the app) never keeps the terminal blank while a long prefill runs out.
        if self.engine is not None:
            self.engine.cancel_all()
        self.exit()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_replay(self) -> None:
        if self.engine is not None:
            self.push_screen(ReplayScreen())
        else:
            self.notify("replay needs the embedded engine (not available in attach mode)", severity="warning")

    def action_receipts(self) -> None:
        self.push_screen(ReceiptsScreen(self.receipts_store))

    def action_clear(self) -> None:
        self.messages = self.messages[:1]
        self.dashboard.query_one(ChatView).remove_children()

    # -- chat -------------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    def send(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.engine is None:
            return
        event.input.value = ""
        self.messages.append({"role": "user", "content": text})
        chat = self.dashboard.query_one(ChatView)
        chat.add_message("user", text)
        chat.start_reply()
        self.generate(list(self.messages))

    @work(thread=True, exclusive=True, group="chat")
    def generate(self, messages: list[dict]) -> None:
        from mtplx.chat import render
        from mtplx.engine.request import GenerationRequest
        from mtplx.engine.sampling import SamplingParams

        prompt = render(self.engine.checkpoint.tokenizer, messages)
        request = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=self.max_tokens), session="tui",
                                    source="tui", chat={"messages": messages, "tools": None})
        self.chat_request = request.request_id
        try:
            for _ in self.engine.submit(request):  # events reach the views through the listener
                pass
        except MtplxError as exc:  # the engine is stopping or stopped: say so, never a traceback
            self.call_from_thread(self.notify, str(exc), title="not sent", severity="error")

    @work(thread=True, exclusive=True, group="bank")
    def refresh_bank(self) -> None:
        if self.engine is not None and self.engine.bank is not None:
            try:
                self.post_message(BankChanged(self.engine.call(self.engine.bank.summary)))
            except MtplxError:  # the engine stopped (quitting): nothing left to show
                pass

    @work(thread=True, group="attach")
    def follow(self, url: str) -> None:
        """Attach mode: the server's event stream feeds the same views."""
        import json

        import httpx

        from mtplx.events import event_from_dict

        try:
            with httpx.stream("GET", url.rstrip("/") + "/v1/mtplx/events", timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        event = event_from_dict(json.loads(line[6:]))
                        if event is not None:
                            self.post_message(EngineEventArrived(event))
        except httpx.HTTPError as exc:
            self.call_from_thread(self.notify, f"lost the event stream from {url}: {exc}", severity="error")

    # -- events -----------------------------------------------------------------------------
    def feed(self, events) -> None:
        """Deliver events as if the engine had sent them (tests, replays of recordings)."""
        for event in events:
            self.on_engine_event_arrived(EngineEventArrived(event))

    def on_bank_changed(self, message: BankChanged) -> None:
        self.dashboard.query_one(BankTable).show(message.entries)

    def on_engine_event_arrived(self, message: EngineEventArrived) -> None:
        event = message.event
        if isinstance(event, BankDecision):
            self.dashboard.query_one("#log", RichLog).write(f"{event.action:<10} {event.detail}")
            if event.action == "ssd_failed" and not self._ssd_warned:  # once per outage, not per entry
                self._ssd_warned = True
                self.notify(event.detail, title="SSD tier failing: bank is RAM-only", severity="warning")
            elif event.action == "ssd_recovered":
                self._ssd_warned = False
                self.notify(event.detail, title="SSD tier recovered")
            return
        self.dashboard.query_one(InFlight).track(event)
        status = self.dashboard.query_one("#status", Static)
        ours = event.request_id == self.chat_request
        if isinstance(event, Queued):
            self.sources[event.request_id] = getattr(event.request, "source", "api")
        elif isinstance(event, Restored):
            self.dashboard.query_one(TurnTable).note_restore(event)
            ceiling = f" of ceiling {event.ceiling}" if event.ceiling else ""
            why = f" — {event.shortfall}" if event.shortfall else ""
            status.update(f"prompt {event.prompt_tokens} tokens, {event.cached_tokens} restored{ceiling} "
                          f"({event.source}{', ' + event.anchor if event.anchor else ''}){why}")
        elif isinstance(event, PrefillProgress) and ours:
            status.update(f"prefill {event.done}/{event.total}")
        elif isinstance(event, FirstToken) and ours:
            status.update(f"first token after {event.ttft_s:.3f}s")
        elif isinstance(event, Tokens) and ours:
            self.dashboard.query_one(ChatView).stream(event.text)
        elif isinstance(event, DraftVerified):
            self.dashboard.query_one(AcceptancePanel).verified(event)
        elif isinstance(event, Finished):
            ratio = self.dashboard.query_one(TurnTable).add_turn(event, self.sources.pop(event.request_id, "api"))
            self.dashboard.query_one(TurnChart).add(event.stats.get("ttft_s"), ratio)
            self.dashboard.query_one(AcceptancePanel).add(event.stats, event.request_id)
            if ours:
                from mtplx.chat import parse_reply

                self.messages.append(parse_reply(event.text))
                status.update(f"done: {event.completion_tokens} tokens, finish {event.finish_reason}")
            self.refresh_bank()
        elif isinstance(event, Failed):
            self.sources.pop(event.request_id, None)
            self.notify(event.message, title="request failed", severity="error")
            status.update("failed")
