"""From a validated chat call to engine events, for async handlers.

Rendering goes through the encode cache; the prompt is checked against the context window when
submitted (so an over-long prompt fails before any byte of a stream); events are read from the
engine's queue off the event loop, and leaving early (a dropped client) cancels the generation.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from mtplx.chat import render
from mtplx.engine.request import GenerationRequest
from mtplx.errors import EngineStopped, RequestError
from mtplx.events import TERMINAL, EngineEvent
from mtplx.server.api_error import ApiError, bad_request
from mtplx.server.encode_cache import EncodeCache
from mtplx.server.openai_request import ChatCall

SESSION_HEADERS = ("x-session-id", "x-mtplx-session", "session-id", "x-conversation-id", "x-client-session")


def session_from(headers) -> str | None:
    for name in SESSION_HEADERS:
        if headers.get(name):
            return headers[name][:200]
    return None


def encode(engine, cache: EncodeCache, call: ChatCall, route: str, raw: bytes) -> list[int]:
    key = cache.key(route, raw)
    hit = cache.get(key)
    if hit is not None:
        return hit[0]
    try:
        tokens = render(engine.checkpoint.tokenizer, call.messages, call.tools, enable_thinking=call.enable_thinking)
    except Exception as exc:  # a template error is the request's fault (e.g. roles out of order)
        raise bad_request(f"messages could not be rendered with the chat template: {type(exc).__name__}: {exc}",
                          "messages") from None
    cache.put(key, tokens, {})
    return tokens


def submit(engine, call: ChatCall, prompt: list[int], source: str, session: str | None, raw: bytes | None = None):
    try:
        request = GenerationRequest(tuple(prompt), call.sampling, session=session, source=source,
                                    chat={"messages": call.messages, "tools": call.tools,
                                          "enable_thinking": call.enable_thinking} if call.messages else None,
                                    raw=raw.decode("utf-8", "replace") if raw else None)
        return engine.submit(request)
    except RequestError as exc:
        raise bad_request(str(exc), "messages", "context_length_exceeded" if "context window" in str(exc) else None) from None
    except EngineStopped as exc:  # stopping, or the engine thread died: the client may retry elsewhere
        raise ApiError(503, str(exc), None, "server_error", "engine_unavailable") from None


async def events(submission) -> AsyncIterator[EngineEvent]:
    """The submission's events; cancelling the consumer cancels the generation."""
    try:
        while True:
            event = await asyncio.to_thread(submission.events.get)
            yield event
            if isinstance(event, TERMINAL):
                return
    finally:
        submission.cancel()


def starts_in_reasoning(tokenizer, prompt: list[int]) -> bool:
    return tokenizer.decode(prompt[-4:]).rstrip().endswith("<think>")
