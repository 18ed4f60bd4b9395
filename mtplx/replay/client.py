"""One streamed chat request, measured the way a careful client measures it.

TTFT is taken to the first generated delta (role-only chunks do not count) and, separately, to
the first visible content (null for tool-only answers). A stream that ends without a finish
reason or `[DONE]`, carries an error frame, or lacks usage is rejected: its numbers would lie.

The output hash is of the answer's meaning, not its wire form, so two servers that generated the
same tokens agree: reasoning and content with outer whitespace stripped (servers differ in which
newlines around `<think>` they keep), and tool calls as name + arguments parsed and re-dumped with
sorted keys (call ids are random; argument JSON spacing is the server's choice). A tool call left
unterminated by the token limit is dropped by some servers and shown as text by others, so the
hash ignores content from an unclosed `<tool_call>` on when the finish reason is "length".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import httpx

from mtplx.errors import MtplxError


class ReplayRejected(MtplxError):
    """A response broke the replay contract; the message says how."""


@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_first_token_s: float | None
    ttft_first_visible_s: float | None
    total_s: float
    finish_reason: str
    output_sha256: str
    text: str  # the canonical answer the hash is of (JSON)
    message: dict  # the assistant message as received, for a client to send back


def stream_turn(client: httpx.Client, base_url: str, body: dict, headers: dict) -> TurnResult:
    body = dict(body, stream=True, stream_options={"include_usage": True})
    started = time.perf_counter()
    first = visible = None
    finish, usage, done = None, None, False
    reasoning, content, calls = [], [], {}
    with client.stream("POST", base_url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise ReplayRejected(f"server answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ReplayRejected(f"error frame in the stream: {chunk['error'].get('message')}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                produced = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
                if produced and first is None:
                    first = time.perf_counter() - started
                if delta.get("content") and visible is None:
                    visible = time.perf_counter() - started
                for n, call in enumerate(delta.get("tool_calls") or []):
                    fn = call.get("function") or {}
                    name, args = calls.setdefault(call.get("index", n), ["", ""])
                    calls[call.get("index", n)] = [name + (fn.get("name") or ""), args + (fn.get("arguments") or "")]
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
                content.append(delta.get("content") or "")
                finish = choice.get("finish_reason") or finish
    if not done or finish is None:
        raise ReplayRejected("incomplete stream: it ended without a finish reason and [DONE]")
    if not usage or "prompt_tokens" not in usage:
        raise ReplayRejected("the response carries no usage (stream_options.include_usage was asked for)")
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    shown = "".join(content)
    if finish == "length" and shown.rfind("<tool_call>") > shown.rfind("</tool_call>"):
        shown = shown[: shown.rfind("<tool_call>")]
    answer = {"reasoning": "".join(reasoning).strip(), "content": shown.strip(),
              "tool_calls": [[name, _canonical(args)] for _, (name, args) in sorted(calls.items())]}
    text = json.dumps(answer, ensure_ascii=False, sort_keys=True)
    message = {"role": "assistant", "content": "".join(content)}
    if "".join(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                                 for i, (name, args) in sorted(calls.items())]
    return TurnResult(usage["prompt_tokens"], cached, usage.get("completion_tokens", 0), first, visible,
                      time.perf_counter() - started, finish, hashlib.sha256(text.encode()).hexdigest(), text, message)


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments.strip()
