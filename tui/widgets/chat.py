"""The conversation: one block per message; the assistant block grows as tokens stream in."""

from __future__ import annotations

from rich.markup import escape
from textual.containers import VerticalScroll
from textual.widgets import Static

STYLE = {"user": "bold cyan", "assistant": "bold green", "tool": "bold yellow", "system": "bold magenta"}


class ChatView(VerticalScroll):
    def add_message(self, role: str, text: str) -> Static:
        block = Static(self._format(role, text), classes=f"msg {role}")
        self.mount(block)
        self.scroll_end(animate=False)
        return block

    def start_reply(self) -> None:
        self._reply = ""
        self._block = self.add_message("assistant", "…")

    def stream(self, text: str) -> None:
        self._reply += text
        self._block.update(self._format("assistant", self._reply))
        self.scroll_end(animate=False)

    @staticmethod
    def _format(role: str, text: str) -> str:
        return f"[{STYLE.get(role, 'bold')}]{role}[/]\n{escape(text)}"
