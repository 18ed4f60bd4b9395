"""The OpenAI Responses API (what Codex speaks) <-> the chat form the engine renders. Pure
mapping; the conversations behind `previous_response_id` live in response_store.py.

Input items become chat messages: `instructions` and developer/system messages are system
turns, reasoning + assistant text + function calls in a row are one assistant turn,
`function_call_output` a tool turn. Only function tools are described to the model (Codex's
other kinds, e.g. a freeform `custom` tool, have no JSON-call form here). A follow-up naming
`previous_response_id` is rendered as the stored conversation (its input and output) plus its
own input, so it renders to the same tokens as a client resending the whole history and the
session bank restores it.
"""

from __future__ import annotations

import time
import uuid

from mtplx.engine.sampling import SamplingParams
from mtplx.events import Finished, Tokens
from mtplx.reply_stream import Piece
from mtplx.server import output_format
from mtplx.server.api_error import bad_request
from mtplx.server.context import check_max_tokens
from mtplx.server.media import OPENAI_MEDIA, placeholder
from mtplx.server.openai_request import (ChatCall, _check_text, check_schema, effort_level, flag, sampling_from,
                                         stream_flag, strict_names, template_variables, thinking_for_effort)
from mtplx.server.openai_response import token_logprobs
from mtplx.server.response_store import ResponseStore
from mtplx.server.signature import Signer
from mtplx.server.tool_namespaces import ToolNames, described, strict_shown
from mtplx.server.tool_args import canonical
from mtplx.server.tool_choice import from_openai

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


def _text(content, p: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_text(content, p)
    if not isinstance(content, list):
        raise bad_request(f"{p} must be a string or a list of content parts", p)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list or object here is a bad part, not a crash
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(_check_text(part["text"], f"{p}[{i}].text"))
        elif kind in OPENAI_MEDIA:
            parts.append(placeholder(part))
        else:
            raise bad_request(f"{p}[{i}] must be a text, image or file part", f"{p}[{i}]")
    return "".join(parts)


def to_messages(body: dict, previous: list[dict], signer: Signer | None = None, names: ToolNames | None = None) -> list[dict]:
    """`names`: the prompt names of the request's namespace tools, for calls sent back with a
    `namespace` (they render as the model wrote them, so the bank's prefix still matches)."""
    names = names or ToolNames()
    out = list(previous)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions and not previous:
        out.append({"role": "system", "content": _check_text(instructions, "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not (items or previous):
        raise bad_request("input must be a string or a non-empty list of items", "input")
    turn = None  # the assistant turn being assembled
    for i, item in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{p} must be an object", p)
        kind = item.get("type", "message")
        role = item.get("role")
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            if kind == "reasoning":
                # Readable content first; else our own sealed blob (Codex keeps only that); else a summary.
                sealed = signer.unseal(item.get("encrypted_content")) if signer else None
                text = _text(item["content"], f"{p}.content") if item.get("content") else sealed
                if text is None:
                    text = _text(item.get("summary") or [], f"{p}.summary")
                turn["reasoning_content"] = (turn.get("reasoning_content", "") + "\n\n" + text).strip("\n") if text else turn.get("reasoning_content", "")
            elif kind == "function_call":
                if not isinstance(item.get("name"), str):
                    raise bad_request(f"{p}.name must be a string", f"{p}.name")
                namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
                turn.setdefault("tool_calls", []).append({"id": item.get("call_id") or item.get("id") or f"call_{i}", "type": "function",
                                                          "function": {"name": names.shown(namespace, item["name"]),
                                                                       "arguments": canonical(item.get("arguments", "{}"))}})
            else:
                turn["content"] += _text(item.get("content"), f"{p}.content")
            continue
        turn = None
        if kind == "message":
            if role not in ("user", "system", "developer"):
                raise bad_request(f"{p}.role must be user, assistant, system or developer", f"{p}.role")
            out.append({"role": "user" if role == "user" else "system", "content": _text(item.get("content"), f"{p}.content")})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, f"{p}.output")})
        else:
            raise bad_request(f"{p}.type {kind!r} is not supported", f"{p}.type")
    # One leading system turn: consecutive system messages at the start are joined.
    lead = 0
    while lead < len(out) and out[lead]["role"] == "system":
        lead += 1
    if lead > 1:
        out = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}] + out[lead:]
    return out


def to_tools(raw, names: ToolNames | None = None) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    tools, names = [], names or ToolNames.of(raw)
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}] must be an object", f"tools[{i}]")
        if t.get("type") == "namespace":
            if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                raise bad_request(f"tools[{i}] must be {{'type': 'namespace', 'name': ..., 'tools': [...]}}", f"tools[{i}]")
            for j, f in enumerate(t["tools"]):
                if isinstance(f, dict) and f.get("type") == "function":
                    if not isinstance(f.get("name"), str):
                        raise bad_request(f"tools[{i}].tools[{j}].name must be a string", f"tools[{i}].tools[{j}].name")
                    check_schema(f.get("parameters"), f"tools[{i}].tools[{j}].parameters")
            tools += described(t, names)
        elif t.get("type") == "function":
            if not isinstance(t.get("name"), str):
                raise bad_request(f"tools[{i}].name must be a string", f"tools[{i}].name")
            check_schema(t.get("parameters"), f"tools[{i}].parameters")
            tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                           "parameters": t.get("parameters") or {"type": "object"}}})
    return tools or None


def logprobs_asked(body: dict) -> bool:
    """OpenAI's Responses: `include: ["message.output_text.logprobs"]`, or `top_logprobs` > 0."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise bad_request("include must be a list of strings", "include")
    return "message.output_text.logprobs" in (include or ()) or bool(body.get("top_logprobs"))


def parse_response_call(body: dict, defaults: SamplingParams, limit: int, store: ResponseStore,
                        signer: Signer | None = None) -> ChatCall:
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    if body.get("background"):  # a response run detached and polled for: not built, so never pretended
        raise bad_request("background responses are not supported; stream the response instead", "background")
    # Context kept by OpenAI's other APIs: answering without it would answer another conversation.
    for name, what in (("prompt", "stored prompt templates are"), ("conversation", "conversations (the Conversations API) are")):
        if body.get(name) is not None:
            raise bad_request(f"{name}: {what} not kept by this server; send the input itself, or previous_response_id",
                              name)
    flag(body, "store", default=True)  # checked here; read where the response is kept (app.py)
    schema = output_format.from_responses(body.get("text"))
    names = ToolNames.of(body.get("tools"))  # namespace functions' prompt names, read once per request
    if isinstance(body.get("input"), list) and any(isinstance(i, dict) and i.get("type") == "item_reference"
                                                   for i in body["input"]):
        body = {**body, "input": _referenced(body["input"], store)}
    messages = to_messages(body, store.get(previous) if previous else [], signer, names)
    tools = to_tools(body.get("tools"), names)
    mapped = {k: body[k] for k in ("temperature", "top_p") if k in body}
    if logprobs_asked(body):  # the output text's tokens with `top_logprobs` alternatives each (0-20)
        mapped |= {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}
    if body.get("max_output_tokens") is not None:  # checked under its own name
        mapped["max_tokens"] = check_max_tokens(body["max_output_tokens"], "max_output_tokens")
    stream = stream_flag(body)
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning must be an object such as {'effort': 'low'}", "reasoning")
    thinking = thinking_for_effort(reasoning.get("effort"), "reasoning.effort")
    return ChatCall(messages, tools, sampling_from(mapped, defaults, limit), stream, False, thinking,
                    from_openai(_choice_shown(body.get("tool_choice"), names), tools, body.get("parallel_tool_calls")), schema,
                    strict_tools=strict_names(body.get("tools")) + strict_shown(body.get("tools"), names),
                    prefill_only=cache_options(body).get("prewarm") is True,
                    template_kwargs=template_variables({}, effort_level(reasoning.get("effort"))))


def _referenced(items: list, store: ResponseStore) -> list:
    """`item_reference` items replaced by the kept items they name (an input or output item of a
    response this server keeps)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item_id = item.get("id")
            found = store.item(item_id) if isinstance(item_id, str) else None
            if found is None:
                raise bad_request(f"input[{i}].id {item_id!r} names no item of a response this server keeps "
                                  "(unknown, deleted, sent with store: false, or past the most recently used it keeps)",
                                  f"input[{i}].id")
            item = found
        out.append(item)
    return out


def cache_options(body: dict) -> dict:
    """`prompt_cache_options` (mode, ttl, prewarm, comparison_response_id). Only `prewarm` changes
    what is computed: the prompt goes into the session bank and nothing is generated. The bank
    decides what it keeps and for how long (a `ttl` of the API's cache means nothing here)."""
    options = body.get("prompt_cache_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad_request("prompt_cache_options must be an object", "prompt_cache_options")
    if options.get("prewarm") not in (None, True, False):
        raise bad_request("prompt_cache_options.prewarm must be a boolean", "prompt_cache_options.prewarm")
    if not isinstance(options.get("comparison_response_id"), (str, type(None))):
        raise bad_request("prompt_cache_options.comparison_response_id must be a response id",
                          "prompt_cache_options.comparison_response_id")
    return options


def _choice_shown(choice, names: ToolNames):
    """A named choice of a namespace's function (`{"type": "function", "name", "namespace"}`)
    under the name the model sees."""
    if isinstance(choice, dict) and isinstance(choice.get("namespace"), str) and isinstance(choice.get("name"), str):
        return {**choice, "name": names.shown(choice["namespace"], choice["name"])}
    return choice


def usage(fin: Finished) -> dict:
    reasoning = fin.stats.tokens_by_segment.get("reasoning", 0)
    # cache_write_tokens: the OpenAI SDK requires it; nothing is billed for a write here (as
    # Anthropic's cache_creation_input_tokens is 0), so 0.
    return {"input_tokens": fin.prompt_tokens,
            "input_tokens_details": {"cached_tokens": fin.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": fin.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


def _item(piece_kind: str, text: str = "", name: str | None = None, arguments: str = "") -> dict:
    if piece_kind == "reasoning":
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
    if piece_kind == "tool_call":
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": "call_" + uuid.uuid4().hex[:24],
                "name": name, "arguments": arguments, "status": "completed"}
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def output_messages(output: list[dict], names: ToolNames | None = None) -> list[dict]:
    """A response's output items as the chat messages a follow-up renders."""
    return to_messages({"input": output}, [], names=names) if output else []


class ResponseStream:
    """Builds the Responses API objects and stream events of one response."""

    def __init__(self, model: str, body: dict, signer: Signer | None = None, logprobs: bool = False):
        """`logprobs`: the request asked for the output text's log-probabilities: each text delta
        carries its tokens' entries and the text part all of them (else the lists are empty)."""
        self.signer = signer
        self.pending: list | None = [] if logprobs else None  # content tokens' entries not yet on a delta
        self.entries = 0  # entries the Tokens events carried (Finished.logprobs holds these and the rest)
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.model, self.created, self.body = model, int(time.time()), body
        self.fed = 0  # pieces streamed so far; Finished.pieces holds these and what the end released
        self.output: list[dict] = []
        self.names = ToolNames.of(body.get("tools"))
        self.diagnostics: dict | None = None  # prompt_cache_diagnostics, when a comparison was asked
        self.open: dict | None = None
        self.seq = 0

    def response(self, status: str, fin: Finished | None = None) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": self.output if status != "in_progress" else [], "error": None, "incomplete_details": None,
               "previous_response_id": self.body.get("previous_response_id"),
               "parallel_tool_calls": self.body.get("parallel_tool_calls") is not False,
               "tool_choice": self.body.get("tool_choice", "auto"), "tools": self.body.get("tools") or [],
               "store": self.body.get("store") is not False, "usage": usage(fin) if fin else None}
        if self.diagnostics is not None and status != "in_progress":
            out["prompt_cache_diagnostics"] = self.diagnostics
        options = self.body.get("prompt_cache_options")
        if isinstance(options, dict):  # as applied (a prewarm's output is empty: nothing was generated)
            out["prompt_cache_options"] = {"mode": options.get("mode", "implicit"), "ttl": options.get("ttl", "30m"),
                                           "comparison_response_id": options.get("comparison_response_id")}
        prewarm = cache_options(self.body).get("prewarm") is True  # nothing was to be generated: complete
        if fin is not None and fin.finish_reason == "length" and not prewarm:
            out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return out

    def _event(self, kind: str, **data) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq, **data}

    def start(self) -> list[tuple[str, dict]]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def _close(self) -> list[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            if self.pending:  # entries of text never shown (blank text at the end): on the part they came with
                part["logprobs"] += token_logprobs(self.pending)
                self.pending.clear()
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=part.get("logprobs", [])),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            if self.signer is not None:
                item["encrypted_content"] = self.signer.seal(item["content"][0]["text"])
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=item["content"][0]["text"]))
        return out + [self._event("response.output_item.done", output_index=index, item=item)]

    def tokens(self, event: Tokens) -> list[tuple[str, dict]]:
        self._entries(event.logprobs)
        return self._pieces(event.pieces)

    def _entries(self, entries) -> None:
        self.entries += len(entries)
        if self.pending is not None:
            self.pending += [e for e in entries if e.segment == "content"]

    def _take(self, text: str) -> list[dict]:
        """The entries of the tokens that wrote `text` (a delta), from the oldest not yet given:
        as many as make up its length (a token's text may still be held back, e.g. a possible stop
        string, and then rides on a later delta)."""
        taken, size = [], 0
        while self.pending and size < len(text):
            taken.append(self.pending.pop(0))
            size += len(taken[-1].text)
        return token_logprobs(taken)

    def _pieces(self, pieces) -> list[tuple[str, dict]]:
        self.fed += len(pieces)
        return [e for p in pieces for e in self._piece(p)]

    def _piece(self, p: Piece) -> list[tuple[str, dict]]:
        out = []
        kind = "message" if p.kind == "content" else p.kind
        if p.kind == "tool_call":
            out += self._close()
            namespace, name = self.names.called(p.name)
            item = _item("tool_call", name=name, arguments=p.arguments)
            if namespace is not None:
                item["namespace"] = namespace
            self.output.append(item)
            index = len(self.output) - 1
            out += [self._event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=p.arguments),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=p.arguments),
                    self._event("response.output_item.done", output_index=index, item=item)]
            return out
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            self.open = _item(p.kind)
            self.output.append(self.open)
            index = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=index, item=_empty(self.open)))
            if kind == "message":
                if self.pending is not None:
                    self.open["content"][0]["logprobs"] = []
                out.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=index, content_index=0,
                                       part={"type": "output_text", "text": "", "annotations": []}))
        index = len(self.output) - 1
        part = self.open["content"][0]
        part["text"] += p.text
        if kind != "message":
            return out + [self._event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=p.text)]
        logprobs = self._take(p.text)
        if self.pending is not None:
            part["logprobs"] += logprobs
        return out + [self._event("response.output_text.delta", item_id=self.open["id"], output_index=index,
                                  content_index=0, delta=p.text, logprobs=logprobs)]

    def finish(self, fin: Finished) -> list[tuple[str, dict]]:
        if self.pending is not None:  # what no Tokens event carried (the end released it)
            self._entries(fin.logprobs[self.entries:])
        out = self._pieces(fin.pieces[self.fed:]) + self._close()
        # response.completed even when max_output_tokens cut it (status "incomplete" inside): the
        # event clients wait for to close a turn.
        return out + [self._event("response.completed", response=self.response("completed", fin))]

    def whole(self, fin: Finished) -> dict:
        self._entries(fin.logprobs)
        self._pieces(fin.pieces)
        self._close()
        return self.response("completed", fin)


def _empty(item: dict) -> dict:
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    return {**item, "content": [{"type": "reasoning_text", "text": ""}]} if item["type"] == "reasoning" else item
