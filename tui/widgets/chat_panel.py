"""The chat: one conversation with the embedded engine, one request at a time.

A message typed while a reply generates is shown as queued and sent when that reply ends, so the
history the model sees always alternates user / assistant and no reply is lost. A new chat is a
new session id (the bank keys ceilings and entries by session)."""

from __future__ import annotations

import os
from collections import deque

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from mtplx.errors import MtplxError
from mtplx.events import Failed, Finished, Tokens
from tui.widgets.chat import ChatView

SYSTEM = "You are a careful coding agent. Think before you act."


class PromptInput(Input):
    """Clears itself in the same step that submits: keys typed right after Enter (a fast typist,
    a paste, tmux send-keys) land in the empty box, never get wiped by a later clear."""

    async def action_submit(self) -> None:
        await super().action_submit()
        self.value = ""


def new_session() -> str:
    return f"tui-{os.urandom(3).hex()}"


class ChatPanel(Vertical):
    def __init__(self, attached: bool, **kwargs):
        super().__init__(**kwargs)
        self.attached = attached
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        self.session = new_session()
        self.pending: deque[tuple[str, Static]] = deque()  # typed while a reply generates
        self.request_id: str | None = None  # the chat's request in flight
        self.busy = False
        self._submission = None

    def compose(self) -> ComposeResult:
        yield ChatView(id="chat")
        placeholder = ("Attached: chat from your agent; this view follows the server" if self.attached
                       else "Message the model (Enter to send; F1 keys)")
        yield PromptInput(placeholder=placeholder, id="prompt", disabled=self.attached)

    def on_mount(self) -> None:
        if self.app.is_headless:  # tests and snapshots: a steady cursor, never caught mid-blink
            self.query_one(Input).cursor_blink = False

    @property
    def view(self) -> ChatView:
        return self.query_one(ChatView)

    @on(Input.Submitted, "#prompt")
    def typed(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.app.engine is None:
            return
        if self.busy:
            self.pending.append((text, self.view.add_message("user", text, queued=True)))
            self.app.notify(f"queued: {len(self.pending)} message(s) wait for the reply", timeout=2)
        else:
            self.send(text, self.view.add_message("user", text))

    def send(self, text: str, block: Static) -> None:
        from mtplx.chat import chat_request
        from mtplx.engine.sampling import SamplingParams

        self.busy = True
        self.messages.append({"role": "user", "content": text})
        self.view.mark_sent(block)
        self.view.start_reply(after=block)
        engine = self.app.engine
        request = chat_request(engine.checkpoint.tokenizer, self.messages,
                               sampling=SamplingParams(max_tokens=self.app.max_tokens), session=self.session, source="tui")
        self.request_id = request.request_id  # set before submit: its first event may arrive at once
        self.generate(request)

    @work(thread=True, group="chat")
    def generate(self, request) -> None:
        try:
            self._submission = self.app.engine.submit(request)
            for _ in self._submission:  # events reach the views through the app's listener
                pass
        except MtplxError as exc:  # the engine is stopping or stopped: say so, never a traceback
            self.app.call_from_thread(self.ended, None, str(exc))

    def engine_event(self, event) -> None:
        """An engine event of any source; only the chat's own request changes the conversation."""
        if event.request_id != self.request_id or self.request_id is None:
            return
        if isinstance(event, Tokens):
            self.view.stream(event.text)
        elif isinstance(event, (Finished, Failed)):
            self.ended(event, event.message if isinstance(event, Failed) else None)

    def ended(self, finished: Finished | None, error: str | None) -> None:
        from mtplx.receipts.writer import client_finish

        self.request_id, self._submission = None, None
        if finished is not None and isinstance(finished, Finished) and finished.finish_reason != "cancelled":
            reply = finished.reply  # split once by the engine, as the server sends it
            self.messages.append(reply)
            self.view.finish_reply(reply, client_finish(finished.finish_reason, len(reply.get("tool_calls", []))))
        else:  # the user message stays on screen, but leaves the history (it was never answered)
            self.messages.pop()
            self.view.fail_reply(error or "cancelled")
        self.busy = False
        if self.pending:
            self.send(*self.pending.popleft())

    def new_chat(self) -> None:
        """A new conversation and session; a reply still generating is cancelled."""
        if self._submission is not None:
            self._submission.cancel()
        self.request_id, self._submission, self.busy = None, None, False
        self.pending.clear()
        self.messages = self.messages[:1]
        self.session = new_session()
        self.view.remove_children()
