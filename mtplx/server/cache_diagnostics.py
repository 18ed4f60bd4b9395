"""Prompt-cache diagnostics: a client names its previous response and is told whether this
request reused that one's cache, and if not, what changed (Anthropic's `diagnostics`, OpenAI
Responses' `prompt_cache_options.comparison_response_id`).

Both APIs compare request fingerprints. Here the session bank's own outcome decides hit or miss:
a request that restored at least the previous request's prompt was a hit. A miss names the first
field that changed, in the order a prompt renders them (the system prompt, tools and settings,
then the messages), and how many of the previous prompt's tokens were not reused. The model name
and a cache key are never the reason: one model is served whatever the name, and the bank matches
prompts by their tokens, not by key. When
every field and message of the previous request is unchanged (only new messages came after) and
the bank still restored less, the miss is the server's (an evicted entry, a history the template
renders differently) and the answer is "unavailable", as the APIs say when they cannot tell; the
receipt of the turn (mtplx receipts, the TUI's turns panel) names that cause exactly.

A response is remembered when its request asked for diagnostics (Anthropic's `diagnostics`, with
a null id on a first turn; Responses' `prompt_cache_options`), as both APIs have clients opt in.
Fingerprints are kept in memory for the 1,024 most recent: a restart forgets them, and a request
naming a forgotten one is told it was not found. Hashing a long conversation takes milliseconds,
so the routes compute fingerprints on a worker thread, never on the event loop."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from mtplx.server.api_error import bad_request


def _digest(value) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).digest()[:8]


@dataclass(frozen=True)
class Fingerprint:
    fields: tuple[tuple[str, bytes], ...]  # (reason if it changed, digest), in prompt order
    messages: bytes  # 8 bytes of digest per message: a long agent conversation costs a few KB
    prompt_tokens: int = 0

    @classmethod
    def of(cls, fields: list[tuple[str, object]], messages: list, prompt_tokens: int = 0) -> Fingerprint:
        return cls(tuple((reason, _digest(value)) for reason, value in fields), b"".join(_digest(m) for m in messages),
                   prompt_tokens)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "hit", "miss", "not_found" or "unavailable"
    reason: str | None = None  # a miss: the first field that changed
    missed: int = 0  # the previous prompt's tokens not reused
    reusable: int = 0  # the previous prompt's tokens


class CacheDiagnostics:
    def __init__(self, capacity: int = 1024):
        self.capacity, self.lock = capacity, threading.Lock()
        self.kept: OrderedDict[str, Fingerprint] = OrderedDict()

    def remember(self, response_id: str, fingerprint: Fingerprint) -> None:
        with self.lock:
            self.kept[response_id] = fingerprint
            while len(self.kept) > self.capacity:
                self.kept.popitem(last=False)

    def compare(self, previous_id: str, now: Fingerprint, cached_tokens: int, messages_reason: str) -> Verdict:
        """This request (restored `cached_tokens`) against the response `previous_id`."""
        with self.lock:
            before = self.kept.get(previous_id)
        if before is None:
            return Verdict("not_found")
        if cached_tokens >= before.prompt_tokens - 1:  # all of it (the last token is always recomputed)
            return Verdict("hit")
        missed = before.prompt_tokens - cached_tokens
        changed = next((reason for (reason, a), (_, b) in zip(before.fields, now.fields) if a != b), None)
        if changed is None and now.messages[: len(before.messages)] != before.messages:
            changed = messages_reason
        if changed is None:
            return Verdict("unavailable", missed=missed, reusable=before.prompt_tokens)
        return Verdict("miss", changed, missed, before.prompt_tokens)


def anthropic_asked(body: dict) -> tuple[bool, str | None]:
    """Whether the request asked for diagnostics, and the message it compares with (None: opted
    in on a first turn, nothing to compare)."""
    asked = body.get("diagnostics")
    if asked is None:
        return False, None
    previous = asked.get("previous_message_id") if isinstance(asked, dict) else 0
    if previous is not None and not isinstance(previous, str):
        raise bad_request("diagnostics must be {'previous_message_id': a message id or null}", "diagnostics")
    return True, previous


def anthropic_fingerprint(body: dict, prompt_tokens: int = 0) -> Fingerprint:
    fields = [("system_changed", body.get("system")),
              ("tools_changed", body.get("tools")),
              # what else changes the prompt: Anthropic answers such a miss "unavailable"
              ("unavailable", [body.get("thinking"), body.get("output_config")])]
    return Fingerprint.of(fields, list(body.get("messages") or []), prompt_tokens)


def anthropic_diagnostics(verdict: Verdict | None) -> dict | None:
    """The Message's `diagnostics`: null for a hit (no divergence) or when not asked."""
    if verdict is None or verdict.kind == "hit":
        return None
    if verdict.kind == "not_found":
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if verdict.kind == "unavailable" or verdict.reason == "unavailable":
        return {"cache_miss_reason": {"type": "unavailable"}}
    return {"cache_miss_reason": {"type": verdict.reason, "cache_missed_input_tokens": verdict.missed}}


def openai_fingerprint(body: dict, messages: list[dict], prompt_tokens: int = 0) -> Fingerprint:
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    fields = [("tools_changed", body.get("tools")), ("text_format_changed", text.get("format")),
              ("reasoning_effort_changed", reasoning.get("effort")), ("verbosity_changed", text.get("verbosity"))]
    return Fingerprint.of(fields, messages, prompt_tokens)


def openai_diagnostics(verdict: Verdict) -> dict:
    """The Response's `prompt_cache_diagnostics`."""
    if verdict.kind == "hit":
        return {"type": "cache_hit"}
    if verdict.kind == "not_found":
        return {"type": "comparison_response_not_found"}
    if verdict.kind == "unavailable":
        return {"type": "unavailable"}
    return {"type": "cache_miss", "reason": verdict.reason, "cache_missed_tokens": verdict.missed,
            "comparison_reusable_tokens": verdict.reusable}
