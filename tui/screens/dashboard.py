"""The main screen: chat on the left; turns (table + TTFT/ratio chart), bank (entries + the
selected entry's anchor map), acceptance, requests in flight and the bank's decision log on the
right."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, RichLog, Static

from tui.widgets.acceptance import AcceptancePanel
from tui.widgets.anchor_map import AnchorMap
from tui.widgets.bank import BankTable
from tui.widgets.chat import ChatView
from tui.widgets.inflight import InFlight
from tui.widgets.turn_chart import TurnChart
from tui.widgets.turns import TurnTable


class Dashboard(Screen):
    def __init__(self, server_url: str | None, attach_url: str | None):
        super().__init__()
        self.server_url, self.attach_url = server_url, attach_url

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield ChatView(id="chat")
                placeholder = ("Attached: chat from your agent; this view follows the server" if self.attach_url
                               else "Message the model (Enter to send)")
                yield Input(placeholder=placeholder, id="prompt", disabled=bool(self.attach_url))
            with Vertical(id="right"):
                yield TurnTable(id="turns")
                yield TurnChart(id="chart")
                yield BankTable(id="bank")
                yield AnchorMap(id="anchor-map")
                with Horizontal(id="lower"):
                    yield AcceptancePanel(id="acceptance")
                    with Vertical(id="side"):
                        yield InFlight(id="inflight")
                        yield RichLog(id="log", max_lines=500, wrap=True, markup=False)
        endpoint = (f"attached to {self.attach_url}" if self.attach_url else
                    f"endpoint {self.server_url}/v1 (OpenAI + Anthropic)" if self.server_url else "endpoint off")
        yield Static(endpoint, id="endpoint")
        yield Static("idle", id="status")
        yield Footer()

    def on_resize(self) -> None:
        # Below 120 columns the right side keeps what explains a turn (turns, chart, bank, anchor
        # map, acceptance) and drops the requests-in-flight and decision-log boxes.
        self.set_class(self.size.width < 120, "-narrow")

    def on_bank_table_selected(self, message: BankTable.Selected) -> None:
        self.query_one(AnchorMap).show(message.entry)

    def on_mount(self) -> None:
        self.query_one("#log", RichLog).border_title = "bank decisions"
        if not self.attach_url:
            self.query_one("#prompt", Input).focus()
