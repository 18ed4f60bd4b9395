"""Driving a model like an agent does: the transcript supplies user messages and tool results,
the model's own replies go back into the history (as a real client sends them).

This is how cache reuse is measured: a frozen transcript's teacher-forced assistant messages
differ from what the model generated, so they would measure a conversation no agent has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplx.chat import render


@dataclass
class AgentSession:
    name: str
    conversation: dict  # {"messages", "tools"} from mtplx.synth or a converted export
    sent: list[dict] = field(default_factory=list)
    cursor: int = 1

    def __post_init__(self):
        self.sent = [self.conversation["messages"][0]]

    @property
    def tools(self):
        return self.conversation["tools"]

    def next_request(self, tokenizer) -> tuple[list[int], dict] | None:
        """The next prompt (and its chat) — the transcript up to its next assistant turn."""
        msgs = self.conversation["messages"]
        while self.cursor < len(msgs) and msgs[self.cursor]["role"] != "assistant":
            self.sent.append(msgs[self.cursor])
            self.cursor += 1
        if self.cursor >= len(msgs):
            return None
        chat = {"messages": list(self.sent), "tools": self.tools}
        return render(tokenizer, self.sent, self.tools), chat

    def send_back(self, message: dict) -> None:
        """An assistant message exactly as a server answered it (e.g. over HTTP)."""
        self.sent.append(message)
        self.cursor += 1
