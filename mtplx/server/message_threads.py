"""Anthropic's message threads (the `message-threads-2026-08-12` beta): the server holds a
conversation, so a client sends only each turn's new messages.

`thread: {"type": "create"}` asks the server to hold the conversation (system, tools, messages and
the reply) under the reply's id; `{"type": "continue", "previous_message_id": id}` sends only what
came after that reply (a tool result, the next user message), and the system prompt and tools come
from the thread. The Anthropic SDK's tool runner threads by default, so without this its second
request reached the model as a lone tool result, with no history and no tools.

Each continue is expanded to the whole conversation before anything else reads it, so the prompt
renders exactly as a client sending everything would see it rendered, and the session bank
restores it the same way. A thread this server does not know (never held, evicted, or kept by
another server) is a 400 with `error_code: thread_not_found`, on which the SDK sends the whole
history again under a new thread. Held in a small SQLite file next to the response store, with the
same bounds and the same care on a full disk. A response may be continued more than once (the API
refuses a second continue; serving it is harmless here: each continue is a whole conversation)."""

from __future__ import annotations

from pathlib import Path

from mtplx.server.api_error import bad_request
from mtplx.server.response_store import ResponseStore

CREATE_ONLY = ("system", "tools")  # taken from the thread on a continue, never repeated


class MessageThreads:
    def __init__(self, path: Path | None, capacity: int = 1024):
        self.store = ResponseStore(path, capacity, label="thread store")

    def expand(self, body: dict) -> tuple[dict, bool]:
        """The request as the whole conversation (without `thread`), and whether its reply is to be
        held as a thread's next turn."""
        thread = body.get("thread")
        if thread is None:
            return body, False
        kind = thread.get("type") if isinstance(thread, dict) else None
        if kind not in ("create", "continue"):
            raise bad_request("thread must be {'type': 'create'} or {'type': 'continue', 'previous_message_id': ...}", "thread")
        whole = {k: v for k, v in body.items() if k != "thread"}
        if kind == "create":
            return whole, True
        previous = thread.get("previous_message_id")
        if not isinstance(previous, str):
            raise bad_request("thread.previous_message_id must be a string", "thread.previous_message_id")
        repeated = [f for f in CREATE_ONLY if f in body]
        if repeated:
            raise bad_request(f"{' and '.join(repeated)} come from the thread on a continue; send them only with create",
                              repeated[0])
        held = self.store.response(previous)
        if held is None:
            raise bad_request(f"thread {previous!r} is unknown to this server (it keeps its {self.store.capacity} most "
                              f"recently used threads); send the whole conversation with thread type create",
                              "thread.previous_message_id", "thread_not_found")
        new = body.get("messages", [])
        if not isinstance(new, list):
            raise bad_request("messages must be a list", "messages")
        whole["messages"] = held["messages"] + new
        whole.update({f: held[f] for f in CREATE_ONLY if f in held})
        return whole, True

    def hold(self, message_id: str, whole: dict, reply: list[dict]) -> None:
        """Keep the conversation `whole` (as expand returned it) with its reply's content blocks."""
        messages = list(whole.get("messages") or [])
        if reply and messages and messages[-1].get("role") == "assistant":  # the reply went on from a prefill
            last = messages[-1]["content"]
            last = [{"type": "text", "text": last}] if isinstance(last, str) else list(last)
            messages[-1] = {**messages[-1], "content": last + reply}
        elif reply:
            messages.append({"role": "assistant", "content": reply})
        self.store.put(message_id, [], {"messages": messages, **{f: whole[f] for f in CREATE_ONLY if f in whole}})
