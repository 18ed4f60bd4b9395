"""The strip turn, driven over HTTP like an agent: a tool chain, then a new user message.

A Qwen3-style template renders the reasoning of the assistant turns after the last user message;
a new user message moves that boundary, so the whole tool chain comes back re-rendered without
its reasoning. A server that only matches prefixes reuses the system head; mtplx's bank prepares
the stripped rendering while the client is idle (render-ahead). This module measures how much of
that turn each server restores when the new user message comes `idle` seconds after the reply.

    ratio = cached tokens / reuse ceiling, where the ceiling is where the new user message starts
    (everything before it was known to the server when the previous reply ended).

The client sends back each server's own replies, as a real agent does, and the transcript's tool
results and user messages. Every turn's client-side TTFT is kept for the per-turn chart.
"""

from __future__ import annotations

import time
import uuid

import httpx

from mtplx.bank.markers import Markers
from mtplx.bank.spans import message_spans
from mtplx.chat import render
from mtplx.replay.client import stream_turn
from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus
from mtplx.synth.heads import HEADS

SEED = 305  # three user messages, each followed by a tool chain: two strip turns
REPLY_TOKENS = 96


def strip_conversation(seed: int = SEED) -> dict:
    """The conversation, with a fresh nonce at the head of the system message so no server reuses
    an earlier run's prefix."""
    convo = conversation(seed, Corpus(), Sizes(20, 60), 3, HEADS[0])
    system = dict(convo["messages"][0])
    system["content"] = f"[run {uuid.uuid4().hex[:12]}] " + system["content"]
    return {"messages": [system, *convo["messages"][1:]], "tools": convo["tools"]}


def ceiling_of(tokenizer, messages: list[dict], tools) -> int:
    """Where the last message (the new user message) starts in the rendered prompt."""
    prompt = render(tokenizer, messages, tools)
    spans = message_spans(prompt, messages, Markers.from_tokenizer(tokenizer))
    last = [s for s in spans if s.index == len(messages) - 1]
    if not last:
        raise ValueError("the template's turn markers were not found; no ceiling can be computed")
    return last[0].start


def drive(client: httpx.Client, url: str, tokenizer, idle: float, seed: int = SEED) -> dict:
    """Run the whole conversation; wait `idle` seconds before each user message that follows a reply.

    Returns {"turns": [{ttft, prompt, cached, strip, ceiling}...], "strip": {ratio, cached, ceiling, ttft}}
    where "strip" sums every new user message after a tool chain (ratio: restored / ceiling over all
    of them; ttft: the median)."""
    convo = strip_conversation(seed)
    msgs, tools = convo["messages"], convo["tools"]
    session = {"x-session-id": "strip-" + uuid.uuid4().hex[:8]}
    sent, cursor, turns = [msgs[0]], 1, []
    while cursor < len(msgs):
        new_user = False
        while cursor < len(msgs) and msgs[cursor]["role"] != "assistant":
            new_user |= msgs[cursor]["role"] == "user" and any(m["role"] == "assistant" for m in sent)
            sent.append(msgs[cursor])
            cursor += 1
        if cursor >= len(msgs):
            break
        if new_user:
            time.sleep(idle)  # the user reads the reply, then types
        body = {"messages": sent, "tools": tools, "max_tokens": REPLY_TOKENS, "temperature": 0}
        r = stream_turn(client, url, body, session)
        turns.append({"ttft": r.ttft_first_token_s, "prompt": r.prompt_tokens, "cached": r.cached_tokens, "strip": new_user,
                      "ceiling": ceiling_of(tokenizer, sent, tools) if new_user else None})
        sent.append(r.message)
        cursor += 1
    strips = [t for t in turns if t["strip"]]
    if not strips:
        raise ValueError(f"conversation {seed} has no user message after a tool chain")
    ceiling = sum(t["ceiling"] for t in strips)
    restored = sum(min(t["cached"], t["ceiling"]) for t in strips)
    ttfts = sorted(t["ttft"] for t in strips)
    return {"turns": turns, "strip": {"ratio": restored / ceiling, "cached": restored, "ceiling": ceiling,
                                      "ttft": ttfts[len(ttfts) // 2], "count": len(strips)}}
