"""The closed set of engine events: one producer (the engine thread), three consumers (server,
TUI, receipt writer). Every event names its request and carries a monotonic timestamp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Union

from mtplx.reply_stream import Piece


def _now() -> float:
    return time.monotonic()


@dataclass(frozen=True)
class Queued:
    request_id: str
    position: int  # requests ahead of this one
    request: object = field(default=None, repr=False)  # the GenerationRequest (source, session, arm, raw)
    t: float = field(default_factory=_now)


@dataclass(frozen=True)
class Restored:
    """What the prompt could reuse: `cached_tokens` of `prompt_tokens` came from `source`."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    source: str  # "cold", "ram", "ssd", "live"
    anchor: str | None = None  # anchor kind restored at, when the bank chose one
    ceiling: int | None = None  # reuse ceiling of the turn, when known
    shortfall: str | None = None  # why cached < ceiling, when it is
    t: float = field(default_factory=_now)
    entry_id: str | None = None  # the bank entry restored from (None when cold or kept live)
    # What render-ahead had prepared of this prompt's rendering when it arrived: "complete",
    # "partial: N of M tokens", "queued: not started (M tokens)", or None (no render-ahead for it).
    render_ahead: str | None = None
    # What made that entry (Entry.origin): "turn", "render_ahead" or "shared_prompt" (another
    # turn's prompt kept while it ran: engine/shared_prompt.py). Kept here because the entry
    # itself may be gone by the time someone asks why this turn started fast (superseded).
    entry_origin: str | None = None


@dataclass(frozen=True)
class PrefillProgress:
    request_id: str
    done: int  # prompt tokens computed so far in this request (restored ones excluded)
    total: int  # prompt tokens to compute
    t: float = field(default_factory=_now)


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    ttft_s: float  # from submission to the first generated token
    t: float = field(default_factory=_now)


@dataclass(frozen=True)
class Tokens:
    """Newly generated tokens (already checked against stops) and the text they complete."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    segment: str  # "reasoning", "content" or "tool_call" at the first of these tokens
    pieces: tuple[Piece, ...] = ()  # the reply's split: what this text completes (reply_stream.py)
    t: float = field(default_factory=_now)
    logprobs: tuple = ()  # engine/logprobs.TokenLogprob per token, when the request asked for them


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and its top alternatives (engine/logprobs.py)."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), most likely first
    segment: str = "content"  # "reasoning", "content" or "tool_call"


@dataclass(frozen=True)
class DraftVerified:
    """One MTP verify: `accepted` of `drafted` draft tokens kept, by position (1 = depth 1)."""

    request_id: str
    drafted: int
    accepted: int
    segment: str
    t: float = field(default_factory=_now)


@dataclass(frozen=True)
class RequestStats:
    """A finished request's statistics (engine/stats.py accumulates them while it runs)."""

    mode: str = "ar"  # "ar" or "mtp"
    depth: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    verify_calls: int = 0
    drafted_by_depth: tuple[int, ...] = ()
    accepted_by_depth: tuple[int, ...] = ()
    drafted_by_segment: dict[str, int] = field(default_factory=dict)  # "reasoning", "content", "tool_call"
    accepted_by_segment: dict[str, int] = field(default_factory=dict)
    tokens_by_segment: dict[str, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    mtp_prefill_s: float = 0.0  # the MTP head's KV over the prompt, computed after the first token
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float | None = None
    tau: float | None = None  # tokens per verify forward (accepted drafts + the one it samples)
    acceptance_by_depth: tuple[float | None, ...] = ()
    decode_tps: float | None = None
    prefill_tps: float | None = None
    predicted_drafted: int = 0  # predicted-output tokens verified (OpenAI `prediction`)
    predicted_accepted: int = 0  # ... and kept
    queued_s: float = 0.0  # submitted -> admitted (engine/stats.py: sharing the engine)
    rounds: int = 0  # decode rounds after the first token
    batched_rounds: int = 0  # ... of which in a batch
    batch_rows: int = 0  # the batch's rows summed over those rounds
    others_s: float = 0.0  # while it decoded, the engine's time on other requests between its rounds
    rows_mean: float | None = None  # requests decoding together per round, itself included

    @classmethod
    def from_dict(cls, data: dict) -> "RequestStats":
        """From plain data (the event stream's JSON); an unknown key is an error, not dropped."""
        from dataclasses import fields

        names = {f.name for f in fields(cls)}
        if unknown := set(data) - names:
            raise ValueError(f"unknown request statistics: {sorted(unknown)}")
        lists = ("drafted_by_depth", "accepted_by_depth", "acceptance_by_depth")
        return cls(**{k: tuple(v) if k in lists else v for k, v in data.items()})

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: str  # "stop", "length", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str
    token_ids: tuple[int, ...]
    stats: RequestStats = field(default_factory=RequestStats)
    pieces: tuple[Piece, ...] = ()  # the whole reply split once (the Tokens events' pieces, then the rest)
    reply: dict | None = None  # the assistant message those pieces make (reply_stream.message; made if None)
    t: float = field(default_factory=_now)
    logprobs: tuple = ()  # engine/logprobs.TokenLogprob per emitted token, when the request asked for them
    stop_sequence: str | None = None  # the request's stop string that ended the reply (Anthropic reports it)
    prompt_logprobs: tuple = ()  # TokenLogprob of prompt tokens 1.. given those before (request.prompt_logprobs)

    def __post_init__(self):
        if isinstance(self.stats, dict):  # plain data (the event stream's JSON, an empty {}): typed here
            object.__setattr__(self, "stats", RequestStats.from_dict(self.stats))
        elif not isinstance(self.stats, RequestStats):
            raise ValueError(f"Finished.stats must be RequestStats, got {type(self.stats).__name__}")
        if self.reply is None:
            from mtplx.reply_stream import message

            object.__setattr__(self, "reply", message(self.pieces))


@dataclass(frozen=True)
class Failed:
    request_id: str
    message: str
    kind: str  # "invalid_request", "internal", "unavailable" (the engine is stopping or stopped)
    t: float = field(default_factory=_now)


@dataclass(frozen=True)
class BankDecision:
    """A session-bank action: stored, restored, superseded, thinned, evicted, render_ahead."""

    request_id: str | None
    action: str
    detail: str
    t: float = field(default_factory=_now)


EngineEvent = Union[Queued, Restored, PrefillProgress, FirstToken, Tokens, DraftVerified, Finished, Failed, BankDecision]
TERMINAL = (Finished, Failed)


def event_dict(event: EngineEvent) -> dict:
    """An event as plain JSON-able data; a queued request is summarised, not dumped whole."""
    from dataclasses import asdict, fields

    out = {f.name: getattr(event, f.name) for f in fields(event) if f.name != "request"}
    if isinstance(event, Queued) and event.request is not None:
        r = event.request
        out["request"] = {"source": r.source, "session": r.session, "prompt_tokens": len(r.prompt), "arm": r.arm}
    if isinstance(event, (Tokens, Finished)):
        out["token_ids"] = list(out["token_ids"])
    if isinstance(event, Finished):
        out["stats"] = event.stats.as_dict()
    if isinstance(event, (Tokens, Finished)):
        out["pieces"] = [asdict(p) for p in event.pieces]
        out["logprobs"] = [asdict(p) for p in event.logprobs]
    out["type"] = type(event).__name__
    return out


def event_from_dict(data: dict) -> EngineEvent | None:
    """The inverse of event_dict for the event stream (attach mode); unknown types give None."""
    from dataclasses import fields

    cls = {c.__name__: c for c in (Queued, Restored, PrefillProgress, FirstToken, Tokens, DraftVerified, Finished,
                                   Failed, BankDecision)}.get(data.get("type"))
    if cls is None:
        return None
    kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data and f.name != "request"}
    if "token_ids" in kwargs:
        kwargs["token_ids"] = tuple(kwargs["token_ids"])
    if "pieces" in kwargs:
        kwargs["pieces"] = tuple(Piece(**p) for p in kwargs["pieces"])
    for name in ("logprobs", "prompt_logprobs"):
        if name in kwargs:
            kwargs[name] = tuple(TokenLogprob(**{**p, "top": tuple(tuple(t) for t in p["top"])}) for p in kwargs[name] or ())
    if cls is Queued and isinstance(data.get("request"), dict):
        from types import SimpleNamespace

        kwargs["request"] = SimpleNamespace(**data["request"])
    return cls(**kwargs)
