"""Anthropic Messages API <-> the chat form the engine renders. Pure mapping (the signer is
passed in)."""

from __future__ import annotations

import json
import uuid

from mtplx.engine.sampling import SamplingParams
from mtplx.events import Finished, Tokens
from mtplx.server import anthropic_tools, compaction, output_format, prefill
from mtplx.server.api_error import bad_request
from mtplx.server.media import ANTHROPIC_ATTACHMENTS, attached
from mtplx.server.openai_request import (ChatCall, _check_text, check_schema, effort_level, sampling_from, stream_flag,
                                         strict_names, template_variables)
from mtplx.server.signature import Signer
from mtplx.server.tool_args import canonical
from mtplx.server.tool_choice import ToolChoice, from_anthropic
from mtplx.reply_stream import Piece

BILLING_HEADER = "x-anthropic-billing-header:"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def _blocks(content, p: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": _check_text(content, p)}]
    if not isinstance(content, list):
        raise bad_request(f"{p} must be a string or a list of content blocks", p)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{p}[{i}] must be a content block with a type", f"{p}[{i}]")
    return content


def _text_of(content, p: str, media: bool = False) -> str:
    """Text blocks joined; with `media`, image/document/search-result blocks become their text or
    a short placeholder (server/media.py)."""
    if isinstance(content, str):
        return _check_text(content, p)
    parts = []
    for i, b in enumerate(_blocks(content, p)):
        if media and b["type"] in ANTHROPIC_ATTACHMENTS:
            parts.append(attached(b))
            continue
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{p}[{i}] must be a text block", f"{p}[{i}]")
        parts.append(_check_text(b["text"], f"{p}[{i}].text"))
    return "".join(parts)


def _system_text(content, p: str) -> str:
    """A system prompt's text. Claude Code's first block is a billing header for Anthropic's own
    accounting (its hash changes with every request), not an instruction: it is left out so it
    cannot break the prompt's cache."""
    if isinstance(content, list):
        content = [b for b in content if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                              and b["text"].startswith(BILLING_HEADER))]
    return _text_of(content, p)


def to_messages(body: dict, signer: Signer | None = None) -> list[dict]:
    """Anthropic messages as chat messages. System text (the `system` field and system-role
    messages before the first turn) leads as one system message; a system message later in the
    conversation stays where it is (turns.encode folds it when the template refuses that)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    head = []
    if body.get("system") is not None:
        head.append(_system_text(body["system"], "system"))
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"{p}.role must be 'user', 'assistant' or 'system'", f"{p}.role")
        if m["role"] == "system":
            text = _system_text(m.get("content"), f"{p}.content")
            if out:
                out.append({"role": "system", "content": text})
            else:
                head.append(text)
            continue
        blocks = _blocks(m.get("content"), f"{p}.content")
        kept = [b for b in blocks if b["type"] != "compaction"]
        if len(kept) < len(blocks):  # a compaction sent back: its summary first, for what it replaced
            out += [{"role": "user", "content": text} for b in blocks
                    if b["type"] == "compaction" and (text := compaction.sent_back(b))]
            if not kept:
                continue
        out += _assistant(kept, p, signer) if m["role"] == "assistant" else _user(kept, p)
    lead = [{"role": "system", "content": "\n\n".join(t for t in head if t)}] if any(head) else []
    return lead + out


def _assistant(blocks: list[dict], p: str, signer: Signer | None) -> list[dict]:
    msg = {"role": "assistant", "content": "", "tool_calls": []}
    thoughts = []
    for b in blocks:
        if b["type"] == "text":
            msg["content"] += _check_text(str(b.get("text", "")), f"{p}.content")
        elif b["type"] == "thinking":
            # A block signed by this install is our own reasoning, rendered back as reasoning; an
            # unsigned or foreign one is reasoning by its type too (kept, never shown as text).
            thoughts.append(_check_text(str(b.get("thinking", "")), f"{p}.content"))
        elif b["type"] == "redacted_thinking":
            continue  # opaque to anyone but its issuer
        elif b["type"] == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{p}: tool_use needs a name and an input object", p)
            msg["tool_calls"].append({"id": b.get("id", ""), "type": "function",
                                      "function": {"name": b["name"], "arguments": canonical(b.get("input", {}))}})
        else:
            raise bad_request(f"{p}: content block type {b['type']!r} is not supported in an assistant turn", p)
    if thoughts:
        msg["reasoning_content"] = "\n\n".join(thoughts)
    if not msg["tool_calls"]:
        del msg["tool_calls"]
    return [msg]


def _user(blocks: list[dict], p: str) -> list[dict]:
    out, text = [], []
    for b in blocks:
        if b["type"] == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                        "content": _text_of(result, f"{p}.content", media=True) if result is not None else ""})
        elif b["type"] == "text":
            text.append(_check_text(str(b.get("text", "")), f"{p}.content"))
        elif b["type"] in ANTHROPIC_ATTACHMENTS:
            text.append(attached(b))
        else:
            raise bad_request(f"{p}: content block type {b['type']!r} is not supported", p)
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


# Anthropic's server tools, by type prefix (client tools such as bash_* and text_editor_* are run by
# the client, so they are described to the model like any other: anthropic_tools.py).
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def to_tools(raw) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}] needs a name", f"tools[{i}]")
        kind = t.get("type")
        if isinstance(kind, str) and kind.startswith(SERVER_TOOLS):
            # Anthropic runs these itself and returns their results; described as a function here,
            # a call to one would go back to a client that cannot run it.
            raise bad_request(f"tools[{i}]: {kind} is a server tool (the API runs it); this server runs none",
                              f"tools[{i}].type")
        check_schema(t.get("input_schema"), f"tools[{i}].input_schema")
        known = anthropic_tools.described(kind) or {}  # a client tool declared by type alone
        tools.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or known.get("description", ""),
            "parameters": t.get("input_schema") or known.get("input_schema") or {"type": "object"}}})
    return tools or None


def parse_messages_call(body: dict, defaults: SamplingParams, limit: int, require_max_tokens: bool = True,
                        signer: Signer | None = None) -> ChatCall:
    if require_max_tokens and "max_tokens" not in body:
        raise bad_request("max_tokens is required", "max_tokens")
    if body.get("mcp_servers"):  # remote tools the API itself would call: a model here never could
        raise bad_request("mcp_servers (the MCP connector) is not supported by this server; run the MCP server in "
                          "the client and describe its tools in `tools`", "mcp_servers")
    messages, tools = with_format(to_messages(body, signer), body.get("output_config")), to_tools(body.get("tools"))
    mapped = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body}
    if "stop_sequences" in body:
        mapped["stop"] = body["stop_sequences"]
    stream = stream_flag(body)
    thinking, start = thinking_flag(body.get("thinking")), None
    summarising = compaction.asked(body)
    if summarising is not None:  # the conversation as it stands, then the request for its summary
        messages, thinking = messages + [compaction.summary_turn(summarising)], False
    elif messages and messages[-1]["role"] == "assistant":  # a prefill: Claude's reply starts with this text
        messages, start, thinking = prefill.split(messages, thinking)
    choice = ToolChoice("none") if summarising is not None else from_anthropic(body.get("tool_choice"), tools)
    return ChatCall(messages, tools, sampling_from(mapped, defaults, limit), stream, False,
                    thinking, choice,
                    output_format.from_anthropic(body.get("output_config")), prefill=start,
                    reasoning_budget=budget_of(body.get("thinking")), strict_tools=strict_names(body.get("tools")),
                    template_kwargs=template_variables({}, _effort(body.get("output_config"))))


def _effort(config) -> str | None:
    """`output_config.effort` (low / medium / high): the level a template that takes one reads
    (gpt-oss); a local model has no other effort dial."""
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None and not isinstance(effort, str):
        raise bad_request("output_config.effort must be a string such as 'low' or 'high'", "output_config.effort")
    return effort_level(effort)


def with_format(messages: list[dict], config) -> list[dict]:
    """`output_config.format` (Claude Code's title request asks for a JSON schema): the schema is
    also asked for at the end of the system prompt, since Claude is told it and a local model
    otherwise writes the document blind (the fields' names come from the schema alone); the
    reply is held to it on the logits (server/output_format.py). Any other format is a 400."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return messages
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
    ask = "Reply with one JSON object, and nothing else, that matches this JSON schema:\n" + \
        json.dumps(fmt["schema"], ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + ask}] + messages[1:]
    return [{"role": "system", "content": ask}] + messages


def thinking_flag(thinking) -> bool | None:
    """enabled -> on; disabled -> off; adaptive or absent -> the template's own default (the
    model decides whether to reason)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request("thinking.type must be 'enabled', 'adaptive' or 'disabled'", "thinking.type")
    return {"enabled": True, "disabled": False}.get(kind)


def budget_of(thinking) -> int | None:
    """`thinking.budget_tokens` of an enabled block: the reasoning is closed after that many tokens."""
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request(f"thinking.budget_tokens must be a positive integer, got {budget!r}", "thinking.budget_tokens")
    return budget


def error_body(status: int, message: str, kind: str | None = None, code: str | None = None) -> dict:
    """The Anthropic error shape (the Anthropic routes answer in it, OpenAI's in OpenAI's); a
    machine-readable `code` goes in `details.error_code`, where the SDK reads it (thread_not_found)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error = {"type": kind, "message": message}
    if code is not None:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def stop_reason(fin: Finished, tool_calls: int) -> str:
    if fin.finish_reason == "length":
        return "max_tokens"
    if fin.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if tool_calls else "end_turn"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """input_tokens + cache_read_input_tokens = the prompt (what was computed + what was restored)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def message(model: str, fin: Finished, signer: Signer) -> dict:
    pieces = fin.pieces
    content, calls = [], 0
    for kind in ("reasoning", "content"):
        text = "".join(p.text for p in pieces if p.kind == kind)
        if text:
            content.append({"type": "thinking", "thinking": text, "signature": signer.sign(text)} if kind == "reasoning"
                           else {"type": "text", "text": text})
    for p in pieces:
        if p.kind == "tool_call":
            calls += 1
            content.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": p.name,
                            "input": _input(p.arguments)})
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(fin, calls), "stop_sequence": fin.stop_sequence,
            "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}


def summary_of(fin: Finished) -> str:
    return "".join(p.text for p in fin.pieces if p.kind == "content").strip()


def compacted(model: str, fin: Finished, signer: Signer) -> dict:
    """A compaction request's reply: its one block, stop reason "compaction"."""
    return {**message(model, fin, signer), "content": [compaction.block(summary_of(fin), signer)],
            "stop_reason": "compaction", "stop_sequence": None}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageStream:
    """Anthropic stream events, in the documented order, with sequential block indices. A
    thinking block ends with a signature_delta signing the whole block's text."""

    def __init__(self, model: str, signer: Signer):
        self.model, self.signer = model, signer
        self.fed = 0  # pieces streamed so far; Finished.pieces holds these and what the end released
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.index, self.open_kind, self.calls = -1, None, 0
        self.content: list[dict] = []  # the blocks as the client assembles them (a thread holds them)

    def start(self, prompt_tokens: int, cached_tokens: int, extra: dict | None = None) -> list[tuple[str, dict]]:
        """`extra`: fields known once the bank has decided (`diagnostics`)."""
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(prompt_tokens, cached_tokens, 0), **(extra or {})}})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "reasoning":
            self.content[-1]["signature"] = self.signer.sign(self.content[-1]["thinking"])
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "signature_delta", "signature": self.content[-1]["signature"]}}))
        self.open_kind = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        self.content.append(dict(block))
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def tokens(self, event: Tokens) -> list[tuple[str, dict]]:
        return self._pieces(event.pieces)

    def _pieces(self, pieces) -> list[tuple[str, dict]]:
        self.fed += len(pieces)
        return [e for p in pieces for e in self._piece(p)]

    def _piece(self, p: Piece) -> list[tuple[str, dict]]:
        out = []
        if p.kind == "tool_call":
            self.calls += 1
            out += self._open("tool_use", {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": p.name, "input": {}})
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "input_json_delta", "partial_json": p.arguments}}))
            self.content[-1]["input"] = _input(p.arguments)
            return out + self._close()
        if p.kind != self.open_kind:
            block = {"type": "thinking", "thinking": "", "signature": ""} if p.kind == "reasoning" else {"type": "text", "text": ""}
            out += self._open(p.kind, block)
        self.content[-1]["thinking" if p.kind == "reasoning" else "text"] += p.text
        delta = {"type": "thinking_delta", "thinking": p.text} if p.kind == "reasoning" else {"type": "text_delta", "text": p.text}
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def compacted(self, fin: Finished) -> list[tuple[str, dict]]:
        """A compaction's whole stream after message_start: its one block, sent once the summary is
        written (the delta carries the whole summary, as the API's does), then the end."""
        made = compaction.block(summary_of(fin), self.signer)
        self.content = [made]
        return [("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {**made, "content": None}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "compaction_delta", "content": made["content"]}}),
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "compaction", "stop_sequence": None},
                                   "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}),
                ("message_stop", {"type": "message_stop"})]

    def finish(self, fin: Finished) -> list[tuple[str, dict]]:
        out = self._pieces(fin.pieces[self.fed:]) + self._close()
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason(fin, self.calls), "stop_sequence": fin.stop_sequence},
                                      "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}))
        return out + [("message_stop", {"type": "message_stop"})]
