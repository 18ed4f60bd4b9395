"""The conversation: one block per message. A reply streams as plain text; once it finishes it is
re-rendered as the client would show it: reasoning collapsed, content as Markdown, tool calls by
name with their arguments as indented JSON. Messages typed while a reply generates wait, marked
"queued", and go out one at a time in the order typed."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.syntax import Syntax
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

STYLE = {"user": "bold cyan", "assistant": "bold green", "tool": "bold yellow", "system": "bold magenta"}


def label(role: str, note: str = "") -> str:
    return f"[{STYLE.get(role, 'bold')}]{role}[/]" + (f" [dim]· {escape(note)}[/]" if note else "")


class ReplyBlock(Vertical):
    """A finished assistant message (Finished.reply: reply_stream.message's shape) and the finish reason the client saw."""

    def __init__(self, message: dict, finish: str):
        super().__init__(classes="msg assistant reply")
        self.message, self.finish = message, finish

    def compose(self):
        yield Static(label("assistant", f"finish {self.finish}"))
        # The engine's split: reasoning cut off by max_tokens is reasoning here too, never content.
        reasoning, content = self.message.get("reasoning_content"), self.message.get("content") or ""
        if reasoning:
            yield Collapsible(Static(escape(reasoning)), title=f"reasoning · {len(reasoning.split())} words",
                              collapsed=True)
        if content:
            yield Markdown(content)
        for call in self.message.get("tool_calls", []):
            fn = call["function"]
            try:
                args = json.dumps(json.loads(fn["arguments"]), indent=2, ensure_ascii=False)
            except (TypeError, json.JSONDecodeError):  # shown as sent when it is not JSON
                args = str(fn["arguments"])
            yield Static(Text.assemble(("⚙ tool call ", "bold yellow"), (fn["name"], "bold")), classes="tool-call")
            yield Static(Syntax(args, "json", theme="ansi_dark", background_color="default"), classes="tool-args")


class ChatView(VerticalScroll):
    def on_mount(self) -> None:
        self._block: Static | None = None
        self._reply = ""

    def add_message(self, role: str, text: str, queued: bool = False) -> Static:
        block = Static(self._format(role, text, "queued" if queued else ""), classes=f"msg {role}")
        block.chat_text = text  # kept to re-render the label once a queued message is sent
        self.mount(block)
        self.scroll_end(animate=False)
        return block

    def mark_sent(self, block: Static) -> None:
        block.update(self._format("user", block.chat_text))

    def start_reply(self, after: Static | None = None) -> None:
        """The streaming placeholder, right below its user message (queued ones stay below it)."""
        self._reply = ""
        self._block = Static(self._format("assistant", "…"), classes="msg assistant")
        self.mount(self._block, after=after)
        self.scroll_end(animate=False)

    def stream(self, text: str) -> None:
        if self._block is None:
            return
        self._reply += text
        self._block.update(self._format("assistant", self._reply))
        self.scroll_end(animate=False)

    def finish_reply(self, message: dict, finish: str) -> None:
        if self._block is None:
            return
        self.mount(ReplyBlock(message, finish), after=self._block)
        self._block.remove()
        self._block = None
        self.scroll_end(animate=False)

    def fail_reply(self, why: str) -> None:
        if self._block is not None:
            self._block.update(self._format("assistant", self._reply, f"not answered: {why}"))
            self._block = None

    @staticmethod
    def _format(role: str, text: str, note: str = "") -> str:
        return f"{label(role, note)}\n{escape(text)}"
