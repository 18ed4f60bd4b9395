"""From a validated chat call to engine events, for async handlers.

Rendering goes through the encode cache, on a worker thread; the prompt is checked against the
context window when submitted (so an over-long prompt fails before any byte of a stream); events
are read from the engine's queue off the event loop, and leaving early (a dropped client)
cancels the generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
from dataclasses import replace
from typing import AsyncIterator

from mtplx import chat_template
from mtplx.chat import chat_request, render, with_prefill
from mtplx.engine.request import GenerationRequest
from mtplx.errors import EngineStopped, RequestError
from mtplx.events import TERMINAL, EngineEvent, Tokens
from mtplx.server import output_format
from mtplx.server.api_error import ApiError, bad_request
from mtplx.server.context import fit
from mtplx.server.encode_cache import EncodeCache
from mtplx.server.openai_request import ChatCall
from mtplx.server.tool_choice import ToolRules

# Headers naming an agent session: ours and generic ones, then what real clients send
# (recorded in tests/fixtures/clients/): Claude Code, Codex; OpenCode sends x-session-id itself.
SESSION_HEADERS = ("x-session-id", "x-mtplx-session", "session-id", "x-conversation-id", "x-client-session",
                   "x-claude-code-session-id", "session_id", "conversation_id", "x-session-affinity")


def session_from(headers, body: dict | None = None, call: ChatCall | None = None) -> str | None:
    """The client's session id (headers, then body fields), scoped by the conversation's head
    (system prompt + tools): one client session id sent with two different system prompts (an
    agent's main loop and its title or sub-agent requests) names two conversations, and each
    gets its own bank session and reuse ceiling."""
    sid = next((headers[name] for name in SESSION_HEADERS if headers.get(name)), None)
    if sid is None and body is not None:
        sid = _body_session(body)
    if sid is None:
        return None
    sid = str(sid)[:200]
    if call is None or not call.messages:
        return sid
    head = [m for m in call.messages[:1] if m.get("role") == "system"]
    digest = hashlib.sha256(json.dumps([head, call.tools], sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:8]
    return f"{sid}/{digest}"


def _body_session(body: dict) -> str | None:
    """Body fields: OpenAI `prompt_cache_key` (Codex, ...), Anthropic `metadata.user_id` (Claude
    Code puts a JSON object with `session_id` there; older versions `user_..._session_<id>`)."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if isinstance(user, str) and user:
        try:
            parsed = json.loads(user)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
            return parsed["session_id"]
        if "_session_" in user:
            return user.rsplit("_session_", 1)[1] or None
    return None


def encode(engine, cache: EncodeCache, call: ChatCall, route: str, raw: bytes, rules: ToolRules | None = None) -> list[int]:
    output_format.compile_call(engine, call)
    if rules is not None:
        rules.compile(call)
    if call.prediction:  # the ids the reply would have where it repeats the predicted output
        call.prediction_ids = tuple(engine.checkpoint.tokenizer.encode(call.prediction, add_special_tokens=False))
    key = cache.key(route, raw)
    hit = cache.get(key)
    if hit is not None:
        if "messages" in hit[1]:  # folded on the miss: the bank must see what was rendered
            call.messages[:] = hit[1]["messages"]
        return hit[0]
    tokens, extra = render_call(engine, call)
    tokens = with_prefill(engine.checkpoint.tokenizer, tokens, call.prefill)
    cache.put(key, tokens, extra)
    return tokens


def render_call(engine, call: ChatCall, add_generation_prompt: bool = True) -> tuple[list[int], dict]:
    """The call's messages as tokens, and what the encode cache must remember beside them; a
    template's error is the request's 400."""
    try:
        try:
            tokens = render(engine.checkpoint.tokenizer, call.messages, call.tools, enable_thinking=call.enable_thinking,
                            template_kwargs=call.template_kwargs, add_generation_prompt=add_generation_prompt)
        except Exception:
            folded = fold_system(call.messages)
            if folded == call.messages:
                raise
            # Templates that allow a system turn only first (Qwen3's): a later one becomes a user turn.
            tokens = render(engine.checkpoint.tokenizer, folded, call.tools, enable_thinking=call.enable_thinking,
                            template_kwargs=call.template_kwargs, add_generation_prompt=add_generation_prompt)
            call.messages[:] = folded
            return tokens, {"messages": folded}
    except Exception as exc:  # a template error is the request's fault (e.g. roles out of order)
        if not chat_template.present(engine.checkpoint.tokenizer):
            raise bad_request("this model has no chat template (a base model?), so it cannot take chat messages; "
                              "send a prompt to /v1/completions, or add a chat_template.jinja to its directory",
                              "messages", "no_chat_template") from None
        raise bad_request(f"messages could not be rendered with the chat template: {type(exc).__name__}: {exc}",
                          "messages") from None
    return tokens, {}


async def encoded(engine, cache: EncodeCache, call: ChatCall, route: str, raw: bytes,
                  rules: ToolRules | None = None) -> list[int]:
    """`encode` on a worker thread: rendering and tokenizing a long conversation (a 100k-token
    history is ~0.5 MB of text, ~0.5 s here) would otherwise hold the event loop, and with it the
    tokens every other client is being streamed."""
    return await asyncio.to_thread(encode, engine, cache, call, route, raw, rules)


def fold_system(messages: list[dict]) -> list[dict]:
    """System messages after the first message as user turns that say what they are."""
    return [m if m.get("role") != "system" or i == 0 else {"role": "user", "content": f"<system>\n{m['content']}\n</system>"}
            for i, m in enumerate(messages)]


def submit(engine, call: ChatCall, prompt: list[int], source: str, session: str | None, raw: bytes | None = None,
           rules: ToolRules | None = None):
    """Queue the turn with max_tokens capped to what the window leaves (sub.request holds the cap)
    and the tool choice as a rule on the logits (`rules`: the tokenizer's, when it can steer)."""
    budget = fit(call.sampling, len(prompt), engine.context_window)
    tokenizer = engine.checkpoint.tokenizer
    past = [t for t, _ in call.sampling.logit_bias if t >= len(tokenizer)]
    if past:
        raise bad_request(f"logit_bias names token {past[0]}, past this model's vocabulary of {len(tokenizer)}", "logit_bias")
    reasoning = starts_in_reasoning(tokenizer, prompt)
    rule = rules.rule(call.tool_choice, reasoning) if rules and call.messages else None
    output_rule = output_format.rule_for(call, rules, tokenizer, reasoning)
    reasoning_rule = _budget(call, tokenizer, reasoning)
    try:
        text = raw.decode("utf-8", "replace") if raw else None
        if call.messages:
            request = chat_request(engine.checkpoint.tokenizer, call.messages, call.tools, sampling=budget.sampling,
                                   enable_thinking=call.enable_thinking, prompt=prompt, prefill=call.prefill,
                                   template_kwargs=call.template_kwargs,
                                   session=session, source=source,
                                   tool_rule=rule, output_rule=output_rule, reasoning_rule=reasoning_rule, raw=text,
                                   call_rule=rules.call_rule(call) if rules else None,
                                   calls=call.tool_choice.mode != "none",
                                   prediction=call.prediction_ids, prefill_only=call.prefill_only)
        else:  # a text completion: a prompt, no chat
            request = GenerationRequest(tuple(prompt), budget.sampling, session=session, source=source, raw=text,
                                        output_rule=output_rule, prompt_logprobs=call.prompt_logprobs,
                                        prefill_only=call.prefill_only)
        sub = engine.submit(request)
    except RequestError as exc:
        raise bad_request(str(exc), "messages", "context_length_exceeded" if "context window" in str(exc) else None) from None
    except EngineStopped as exc:  # stopping, or the engine thread died: the client may retry elsewhere
        raise ApiError(503, str(exc), None, "server_error", "engine_unavailable") from None
    return sub


class Choices:
    """The turns of a request's `n` choices as one submission: a client that goes away cancels them all."""

    def __init__(self, subs: list):
        self.subs = subs
        self.request = subs[0].request  # what every choice runs under (max_tokens capped alike)

    def cancel(self) -> None:
        for sub in self.subs:
            sub.cancel()


# Once a reply streams, its deltas go out at most every STREAM_INTERVAL seconds instead of every
# MTP round or AR token: each wake-up of the event loop (and of the client reading the stream)
# takes a core from the engine's two threads for a moment, and on a small machine that was a tenth
# or more of decode speed (docs/engine.md, "events"). The first STREAM_LEAD Tokens events and the
# terminal one go out at once, so TTFT, a short turn and the end of a reply never wait.
# MTPLX_STREAM_INTERVAL_MS=0 sends every event as it comes.
STREAM_INTERVAL = float(os.environ.get("MTPLX_STREAM_INTERVAL_MS", "10")) / 1e3
STREAM_LEAD = 4


def submit_choices(engine, call: ChatCall, prompt: list[int], source: str, session: str | None, raw: bytes | None,
                   rules: ToolRules | None) -> list:
    """A turn per choice, each with rules of its own (a schema's or a call's matcher holds state).
    Seeded, choice i draws with seed + i, so the choices differ and each repeats. The session goes
    with the first choice only: the bank keeps one reply as the conversation's continuation."""
    subs = []
    for i in range(call.n):
        sampling = call.sampling if call.sampling.seed is None else replace(call.sampling, seed=(call.sampling.seed + i) % 2**64)
        subs.append(submit(engine, replace(call, sampling=sampling), prompt, source, session if i == 0 else None, raw,
                           rules))
    return subs


async def events(submission) -> AsyncIterator[EngineEvent]:
    """The submission's events; a consumer that leaves early cancels the generation at its next
    prefill chunk or decode step. The engine keeps a cancelled prefill's computed prefix in the
    bank, so an agent CLI that gave up on a long prompt (Claude Code after 300 s) and resends it
    restores that part instead of starting over, while requests queued behind it run at once."""
    loop, ready = asyncio.get_running_loop(), asyncio.Event()
    # Set while a wake-up is on its way and the loop has not yet found the queue empty: the events
    # the engine publishes meanwhile (an MTP round's DraftVerified, then its Tokens) ride on that
    # one wake-up, instead of one self-pipe write and one loop pass each. While the loop waits out
    # the stream interval it stays set, so only a terminal event wakes it early.
    armed, pausing = [False], [False]

    def wake(event=None) -> None:  # on the engine thread
        if armed[0] and not (pausing[0] and isinstance(event, TERMINAL)):
            return
        armed[0] = True
        try:
            loop.call_soon_threadsafe(ready.set)
        except RuntimeError:  # the loop has closed (server shutdown): nobody is waiting
            pass

    # At most one wake-up at a time on the loop's own self-pipe; the loop drains whatever is queued.
    # A pool thread parked in `events.get` per event cost two thread hand-offs per event: streaming
    # a 160-token tiny-dense answer ran at 158 tok/s with MTP and 128 without; then 323 and 194.
    streamed = 0  # Tokens events handed on
    submission.waker = wake
    try:
        while True:
            try:
                event = submission.events.get_nowait()
            except queue.Empty:
                ready.clear()
                if STREAM_INTERVAL and streamed >= STREAM_LEAD:
                    pausing[0] = True
                    if submission.events.empty():  # a terminal event queued just before is not waited out
                        timer = loop.call_later(STREAM_INTERVAL, ready.set)
                        await ready.wait()
                        timer.cancel()
                    pausing[0] = False
                    ready.clear()
                    if not submission.events.empty():
                        continue
                armed[0] = False  # from here on an event must wake the loop again
                if submission.events.empty():  # an event queued before the clear would be missed
                    await ready.wait()
                continue
            yield event
            if isinstance(event, TERMINAL):
                return
            streamed += isinstance(event, Tokens)
    finally:
        submission.waker = None
        submission.cancel()


def _budget(call: ChatCall, tokenizer, reasoning: bool):
    """The call's reasoning budget as a rule; None without one, or for a model with no reasoning
    block tokens (it has no reasoning to cap)."""
    if call.reasoning_budget is None:
        return None
    think = output_format.think_tokens(tokenizer)
    if think is None:
        return None
    from mtplx.engine.reasoning_budget import ReasoningBudget

    return ReasoningBudget(call.reasoning_budget, think, reasoning)


def starts_in_reasoning(tokenizer, prompt: list[int]) -> bool:
    return tokenizer.decode(prompt[-4:]).rstrip().endswith("<think>")


def budget_headers(call: ChatCall, submission) -> dict:
    """Tells the client what max_tokens the turn runs under when it was capped to the window."""
    given, used = call.sampling.max_tokens, submission.request.sampling.max_tokens
    return {"x-mtplx-max-tokens": str(used)} | ({"x-mtplx-max-tokens-capped-from": str(given)} if used < given else {})
