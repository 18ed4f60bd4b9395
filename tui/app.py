"""`mtplx tui`: chat with the embedded engine and watch each turn's cache reuse and speculation.

The app only routes: engine events arrive through a worker thread as messages and each widget
turns them into pixels. Domain logic (rendering, parsing replies) lives in the core.
"""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Static

from mtplx.events import Failed, Finished, FirstToken, PrefillProgress, Restored, Tokens
from tui.messages import EngineEventArrived
from tui.messages import BankChanged
from tui.widgets.acceptance import AcceptancePanel
from tui.widgets.bank import BankTable
from tui.widgets.chat import ChatView
from tui.widgets.turns import TurnTable

SYSTEM = "You are a careful coding agent. Think before you act."


class MtplxApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mtplx"
    BINDINGS = [("ctrl+q", "quit", "Quit"), ("ctrl+l", "clear", "New conversation")]

    def __init__(self, engine=None, model_name: str = "", max_tokens: int = 256):
        super().__init__()
        self.engine, self.model_name, self.max_tokens = engine, model_name, max_tokens
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        self.source = "tui"

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield ChatView(id="chat")
                yield Input(placeholder="Message the model (Enter to send)", id="prompt")
            with Vertical(id="right"):
                yield TurnTable(id="turns")
                yield BankTable(id="bank")
                yield AcceptancePanel(id="acceptance")
        yield Static("idle", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.model_name or "no engine"
        self.query_one("#prompt", Input).focus()

    # -- chat -------------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    def send(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.engine is None:
            return
        event.input.value = ""
        self.messages.append({"role": "user", "content": text})
        self.query_one(ChatView).add_message("user", text)
        self.query_one(ChatView).start_reply()
        self.generate(list(self.messages))

    @work(thread=True, exclusive=True)
    def generate(self, messages: list[dict]) -> None:
        from mtplx.chat import render
        from mtplx.engine.request import GenerationRequest
        from mtplx.engine.sampling import SamplingParams

        prompt = render(self.engine.checkpoint.tokenizer, messages)
        request = GenerationRequest(tuple(prompt), SamplingParams(max_tokens=self.max_tokens), session="tui",
                                    source="tui", chat={"messages": messages, "tools": None})
        for event in self.engine.submit(request):
            self.post_message(EngineEventArrived(event))
        if self.engine.bank is not None:
            self.post_message(BankChanged(self.engine.call(self.engine.bank.summary)))

    def on_bank_changed(self, message: BankChanged) -> None:
        self.query_one(BankTable).show(message.entries)

    def action_clear(self) -> None:
        self.messages = self.messages[:1]
        self.query_one(ChatView).remove_children()

    # -- events -----------------------------------------------------------------------------
    def feed(self, events) -> None:
        """Deliver events as if the engine had sent them (replay, tests)."""
        for event in events:
            self.on_engine_event_arrived(EngineEventArrived(event))

    def on_engine_event_arrived(self, message: EngineEventArrived) -> None:
        event, status = message.event, self.query_one("#status", Static)
        if isinstance(event, Restored):
            self.query_one(TurnTable).note_restore(event)
            ceiling = f" of ceiling {event.ceiling}" if event.ceiling is not None else ""
            why = f" — {event.shortfall}" if event.shortfall else ""
            status.update(f"prompt {event.prompt_tokens} tokens, {event.cached_tokens} restored{ceiling} "
                          f"({event.source}{', ' + event.anchor if event.anchor else ''}){why}")
        elif isinstance(event, PrefillProgress):
            status.update(f"prefill {event.done}/{event.total}")
        elif isinstance(event, FirstToken):
            status.update(f"first token after {event.ttft_s:.3f}s")
        elif isinstance(event, Tokens):
            self.query_one(ChatView).stream(event.text)
        elif isinstance(event, Finished):
            from mtplx.chat import parse_reply

            self.messages.append(parse_reply(event.text))
            self.query_one(TurnTable).add_turn(event, self.source)
            self.query_one(AcceptancePanel).add(event.stats)
            status.update(f"done: {event.completion_tokens} tokens, finish {event.finish_reason}")
        elif isinstance(event, Failed):
            self.notify(event.message, severity="error")
            status.update("failed")
