"""Frozen transcripts: each turn a complete request body, replayed identically every time.

Assistant messages inside the bodies are the transcript's own (teacher-forced), as a client
would send them back; nothing depends on what a model generates during a replay.

File format (JSON): {"name", "description", "turns": [{"session": str, "body": {chat request}}]}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtplx.errors import MtplxError


@dataclass(frozen=True)
class Turn:
    session: str
    body: dict


@dataclass(frozen=True)
class Transcript:
    name: str
    description: str
    turns: tuple[Turn, ...]

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "description": self.description,
                           "turns": [{"session": t.session, "body": t.body} for t in self.turns]}, indent=1)


def load(path: Path) -> Transcript:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MtplxError(f"{path}: not a readable JSON transcript ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("turns"), list) or not data["turns"]:
        raise MtplxError(f"{path}: a transcript needs a non-empty 'turns' list")
    turns = []
    for i, t in enumerate(data["turns"]):
        body = t.get("body") if isinstance(t, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise MtplxError(f"{path}: turns[{i}].body must be a chat request with messages")
        turns.append(Turn(str(t.get("session", "s1")), body))
    return Transcript(str(data.get("name", Path(path).stem)), str(data.get("description", "")), tuple(turns))


def freeze(conversation: dict, session: str = "s1", max_tokens: int = 64, name: str = "", description: str = "") -> Transcript:
    """A conversation (system, users, assistants, tools) -> one request per assistant turn."""
    msgs, tools = conversation["messages"], conversation.get("tools")
    turns = []
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            body = {"messages": msgs[:k], "max_tokens": max_tokens, "temperature": 0}
            if tools:
                body["tools"] = tools
            turns.append(Turn(session, body))
    return Transcript(name, description, tuple(turns))


def from_export(path: Path, max_tokens: int = 64) -> Transcript:
    """A real client's conversation export (OpenAI messages JSON: a list of messages, or an object
    with "messages" and optional "tools") -> a frozen transcript."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MtplxError(f"{path}: not readable JSON ({exc})") from exc
    messages = data if isinstance(data, list) else data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise MtplxError(f"{path}: expected a list of OpenAI messages (or an object with 'messages')")
    tools = data.get("tools") if isinstance(data, dict) else None
    return freeze({"messages": messages, "tools": tools}, max_tokens=max_tokens, name=Path(path).stem,
                  description=f"converted from {Path(path).name}")


def interleave(*transcripts: Transcript) -> list[Turn]:
    """Turns of several sessions, alternating."""
    out, queues = [], [list(t.turns) for t in transcripts]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out
