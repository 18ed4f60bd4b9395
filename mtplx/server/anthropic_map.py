"""Anthropic Messages API <-> the chat form the engine renders. Pure mapping."""

from __future__ import annotations

import json
import uuid

from mtplx.engine.sampling import SamplingParams
from mtplx.events import Finished
from mtplx.server.api_error import bad_request
from mtplx.server.openai_request import ChatCall, _check_text, sampling_from
from mtplx.reply_stream import Piece, ReplyStream


def _blocks(content, p: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": _check_text(content, p)}]
    if not isinstance(content, list):
        raise bad_request(f"{p} must be a string or a list of content blocks", p)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{p}[{i}] must be a content block with a type", f"{p}[{i}]")
    return content


def _text_of(content, p: str) -> str:
    if isinstance(content, str):
        return _check_text(content, p)
    parts = []
    for i, b in enumerate(_blocks(content, p)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{p}[{i}] must be a text block", f"{p}[{i}]")
        parts.append(_check_text(b["text"], f"{p}[{i}].text"))
    return "".join(parts)


def to_messages(body: dict) -> list[dict]:
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{p}.role must be 'user' or 'assistant'", f"{p}.role")
        blocks = _blocks(m.get("content"), f"{p}.content")
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "", "tool_calls": []}
            for b in blocks:
                if b["type"] == "text":
                    msg["content"] += _check_text(str(b.get("text", "")), f"{p}.content")
                elif b["type"] == "thinking":
                    msg["reasoning_content"] = _check_text(str(b.get("thinking", "")), f"{p}.content")
                elif b["type"] == "tool_use":
                    if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                        raise bad_request(f"{p}: tool_use needs a name and an input object", p)
                    msg["tool_calls"].append({"id": b.get("id", ""), "type": "function",
                                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            if not msg["tool_calls"]:
                del msg["tool_calls"]
            out.append(msg)
            continue
        text = []
        for b in blocks:
            if b["type"] == "tool_result":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": result if isinstance(result, str) else _text_of(result, f"{p}.content")})
            elif b["type"] == "text":
                text.append(_check_text(str(b.get("text", "")), f"{p}.content"))
            else:
                raise bad_request(f"{p}: content block type {b['type']!r} is not supported", p)
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def to_tools(raw) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}] needs a name", f"tools[{i}]")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t.get("input_schema", {"type": "object"})}})
    return tools or None


def parse_messages_call(body: dict, defaults: SamplingParams, limit: int, require_max_tokens: bool = True) -> ChatCall:
    if require_max_tokens and "max_tokens" not in body:
        raise bad_request("max_tokens is required", "max_tokens")
    messages, tools = to_messages(body), to_tools(body.get("tools"))
    mapped = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body}
    if "stop_sequences" in body:
        mapped["stop"] = body["stop_sequences"]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    thinking = body.get("thinking")
    enable = None if thinking is None else (isinstance(thinking, dict) and thinking.get("type") == "enabled")
    return ChatCall(messages, tools, sampling_from(mapped, defaults, limit), stream, False, enable, None)


def stop_reason(fin: Finished, tool_calls: int) -> str:
    if fin.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if tool_calls else "end_turn"


def _usage(fin: Finished) -> dict:
    return {"input_tokens": fin.prompt_tokens - fin.cached_tokens, "output_tokens": fin.completion_tokens,
            "cache_read_input_tokens": fin.cached_tokens, "cache_creation_input_tokens": 0}


def message(model: str, fin: Finished, in_reasoning: bool) -> dict:
    pieces = ReplyStream(in_reasoning).feed(fin.text, final=True)
    content, calls = [], 0
    for kind in ("reasoning", "content"):
        text = "".join(p.text for p in pieces if p.kind == kind)
        if text:
            content.append({"type": "thinking", "thinking": text, "signature": ""} if kind == "reasoning"
                           else {"type": "text", "text": text})
    for p in pieces:
        if p.kind == "tool_call":
            calls += 1
            content.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": p.name,
                            "input": _input(p.arguments)})
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(fin, calls), "stop_sequence": None, "usage": _usage(fin)}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageStream:
    """Anthropic stream events, in the documented order, with sequential block indices."""

    def __init__(self, model: str, in_reasoning: bool, prompt_tokens: int):
        self.model, self.reply = model, ReplyStream(in_reasoning)
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.prompt_tokens = prompt_tokens
        self.index, self.open_kind, self.calls = -1, None, 0

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def text(self, text: str, final: bool = False) -> list[tuple[str, dict]]:
        out = []
        for p in self.reply.feed(text, final):
            out += self._piece(p)
        return out

    def _piece(self, p: Piece) -> list[tuple[str, dict]]:
        out = []
        if p.kind == "tool_call":
            self.calls += 1
            out += self._open("tool_use", {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": p.name, "input": {}})
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "input_json_delta", "partial_json": p.arguments}}))
            return out + self._close()
        if p.kind != self.open_kind:
            block = {"type": "thinking", "thinking": "", "signature": ""} if p.kind == "reasoning" else {"type": "text", "text": ""}
            out += self._open(p.kind, block)
        delta = {"type": "thinking_delta", "thinking": p.text} if p.kind == "reasoning" else {"type": "text_delta", "text": p.text}
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def finish(self, fin: Finished) -> list[tuple[str, dict]]:
        out = self.text("", final=True) + self._close()
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason(fin, self.calls), "stop_sequence": None},
                                      "usage": _usage(fin)}))
        return out + [("message_stop", {"type": "message_stop"})]
