"""OpenAI request bodies -> validated chat calls. Pure functions; every problem is a 400 that
names the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from mtplx.engine.sampling import SamplingParams
from mtplx.errors import RequestError
from mtplx.server.api_error import ApiError, bad_request
from mtplx.server.context import check_max_tokens
from mtplx.server.media import OPENAI_MEDIA, placeholder
from mtplx.server import output_format, prefill
from mtplx.server.tool_args import canonical
from mtplx.server.tool_choice import ToolChoice, from_openai

MAX_BODY = 16 << 20
MAX_DEPTH = 100  # a real request nests ~10 levels (a tool's JSON schema inside a tool inside the list)
ROLES = {"system", "developer", "user", "assistant", "tool"}
# Fields that change what the model must do; accepting them silently would be a lie.
UNSUPPORTED = {"functions": "functions (use tools)", "audio": "audio"}


@dataclass
class ChatCall:
    messages: list[dict]
    tools: list[dict] | None
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    enable_thinking: bool | None = None
    tool_choice: ToolChoice = ToolChoice()
    schema: dict | None = None  # the reply held to this JSON schema (server/output_format.py)
    grammar: object = None  # the schema compiled for the model's tokenizer, when the call is encoded
    prefill: str | None = None  # the reply continues this text (server/prefill.py); not in `messages`
    reasoning_budget: int | None = None  # reasoning tokens allowed before it is closed (Anthropic's budget_tokens)
    prediction: str | None = None  # the predicted output's text (engine/prediction.py: drafts, never output)
    prediction_ids: tuple[int, ...] = ()  # ... as token ids, when the call is encoded
    strict_tools: tuple[str, ...] = ()  # tools whose calls must follow their schema (`strict: true`)
    n: int = 1  # choices asked for (chat's `n`): that many turns of the same prompt, decoded together
    call_grammar: object = None  # a tool call's body held to the tools (ToolRules.compile), when encoded
    prompt_logprobs: int | None = None  # a text completion's echo + logprobs: the prompt scored too
    prefill_only: bool = False  # compute the prompt, generate nothing (a prewarm; completions' max_tokens 0)
    template_kwargs: dict | None = None  # further template variables (chat_template_kwargs, a reasoning effort)


def _reject_constant(name: str):
    raise bad_request(f"invalid number {name} in JSON body")


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY}", code="body_too_large")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise bad_request(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    if _depth(body) > MAX_DEPTH:  # every later step (schemas, templates, receipts) walks it recursively
        raise bad_request(f"request body is nested deeper than {MAX_DEPTH} levels")
    return body


def _depth(value) -> int:
    """How deeply a parsed JSON value nests (without recursing, so any depth is measured)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            todo += [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, level + 1) for v in item]
    return deepest


def _check_text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} contains a lone surrogate (not valid Unicode text)", param) from None
    return value


def message_text(content, param: str) -> str:
    """String content or a list of text parts, as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_text(content, param)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in OPENAI_MEDIA:
                parts.append(placeholder(part))
                continue
            if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(_check_text(part["refusal"], f"{param}[{i}].refusal"))  # an assistant's refusal, as said
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}[{i}] must be a text part ({{'type': 'text', 'text': ...}})", f"{param}[{i}]")
            parts.append(_check_text(part["text"], f"{param}[{i}].text"))
        return "".join(parts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def thinking_for_effort(effort, param: str) -> bool | None:
    """OpenAI's reasoning effort as the template's thinking switch: "none" and "minimal" turn
    thinking off; any other level leaves the template's default (a local model has no effort
    dial). Unknown level names pass, since clients send newer ones (Codex's "xhigh")."""
    if effort is None:
        return None
    if not isinstance(effort, str):
        raise bad_request(f"{param} must be a string such as 'low' or 'high'", param)
    return False if effort in ("none", "minimal") else None


def effort_level(effort) -> str | None:
    """OpenAI's reasoning effort as the level a template takes (gpt-oss's `Reasoning: low |
    medium | high`): "none" and "minimal" are its lowest, Codex's "xhigh" its highest; unknown
    names leave the template's default. A non-string is refused by thinking_for_effort."""
    if not isinstance(effort, str):
        return None
    return {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
            "xhigh": "high"}.get(effort)


# apply_chat_template's own parameters: the server sets these, a request's template variables cannot
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_variables(kwargs: dict, effort: str | None = None) -> dict | None:
    """`chat_template_kwargs` as the template's variables (vLLM's extension: DeepSeek V3.1's
    `thinking`, gpt-oss's `reasoning_effort`, a template's own switches), with a request's
    reasoning effort as `reasoning_effort` unless the kwargs name one; None when there are none.
    `enable_thinking` travels on its own (ChatCall.enable_thinking)."""
    reserved = sorted(k for k in kwargs if k in _RESERVED)
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]} is the server's to set, not a template variable",
                          f"chat_template_kwargs.{reserved[0]}")
    out = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    if effort is not None:
        out.setdefault("reasoning_effort", effort)
    return out or None


def parse_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object", p)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"{p}.role must be one of {sorted(ROLES)}, got {role!r}", f"{p}.role")
        msg = {"role": "system" if role == "developer" else role, "content": message_text(m.get("content"), f"{p}.content")}
        if role == "assistant":
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = _check_text(m["reasoning_content"], f"{p}.reasoning_content")
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise bad_request(f"{p}.tool_call_id must be a string", f"{p}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_calls(raw, p: str) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request(f"{p} must be a list", p)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{p}[{j}].function.name must be a string", f"{p}[{j}].function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"{p}[{j}].function.arguments must be a JSON string", f"{p}[{j}].function.arguments")
        calls.append({"id": call.get("id") or f"call_{j}", "type": "function",
                      "function": {"name": fn["name"], "arguments": canonical(args)}})
    return calls


def parse_tools(raw, tool_choice) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        check_schema(fn.get("parameters"), f"tools[{i}].function.parameters")
    # Described in the prompt whatever tool_choice says: the choice is enforced on the logits
    # (server/tool_choice.py), so the prompt and its cache stay the same across choices.
    return raw or None


def strict_names(raw) -> tuple[str, ...]:
    """The tools a request marks `strict: true` (chat nests it in `function`; Responses and
    Anthropic put it on the tool): their calls' arguments are held to their schema."""
    out = []
    for tool in raw if isinstance(raw, list) else ():
        spec = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(spec, dict) and spec.get("strict") is True and isinstance(spec.get("name"), str):
            out.append(spec["name"])
    return tuple(out)


def check_schema(schema, param: str) -> None:
    """A tool's parameters: absent, or a JSON schema object (the template and the tool rule read it)."""
    if schema is not None and not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field of a request body: a boolean, or null / absent for the default, as OpenAI
    and Anthropic read it (clients that serialise unset fields send null)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def stream_flag(body: dict) -> bool:
    return flag(body, "stream")


def _number(body: dict, name: str, kind=float, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad_request(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"{name} must be finite", name)
    return value


MOST_CHOICES = 16  # `n` (chat, completions): each choice is a turn of its own (its prefill too), decoded in one batch


def choices(body: dict) -> int:
    n = _number(body, "n", int, 1)
    if not 1 <= n <= MOST_CHOICES:
        raise bad_request(f"n must be an integer in 1..{MOST_CHOICES}, got {n}", "n")
    return n


def sampling_from(body: dict, defaults: SamplingParams, max_tokens_limit: int, several: bool = False) -> SamplingParams:
    """`several`: the route takes `n` (checked by `choices`); elsewhere n must be 1."""
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, {}, {"type": "text"}):
            raise bad_request(f"{what} is not supported by this server", key)
    if body.get("web_search_options") is not None:  # even {} asks for a search this server cannot make
        raise bad_request("web_search_options (web search) is not supported by this server", "web_search_options")
    if not several and _number(body, "n", int, 1) != 1:
        raise bad_request("n must be 1 on this route (chat and text completions take more)", "n")
    # A large max_tokens is a client default, capped to the window once the prompt is known
    # (server/context.py); only a non-positive or absurd value is refused here.
    max_tokens = check_max_tokens(body.get("max_completion_tokens"), "max_completion_tokens")
    if max_tokens is None:
        max_tokens = check_max_tokens(body.get("max_tokens"))
    max_tokens = max_tokens or defaults.max_tokens
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    if stop is None or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", default=defaults.temperature),
            top_p=_number(body, "top_p", default=defaults.top_p),
            top_k=_number(body, "top_k", int, defaults.top_k),
            min_p=_number(body, "min_p", default=defaults.min_p),
            seed=_number(body, "seed", int),
            max_tokens=max_tokens,
            stop=stop,
            repetition_penalty=_number(body, "repetition_penalty", default=1.0),
            presence_penalty=_number(body, "presence_penalty", default=0.0),
            frequency_penalty=_number(body, "frequency_penalty", default=0.0),
            ignore_eos=body.get("ignore_eos", False),
            logit_bias=_logit_bias(body.get("logit_bias")),
            logprobs=_logprobs(body),
        )
    except RequestError as exc:
        raise bad_request(str(exc), str(exc).split(" ")[0]) from None


def _logprobs(body: dict) -> int | None:
    """How many alternatives to report per token (None: no log-probabilities). Chat sends
    `logprobs: true` with `top_logprobs`; /v1/completions sends `logprobs` as that number."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if value is None or value is False:
        if top not in (None, 0):
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if value is True:
        value, name = (0 if top is None else top), "top_logprobs"
    else:
        name = "logprobs"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20:
        raise bad_request(f"{name} must be an integer in [0, 20], got {value!r}", name)
    return value


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """`{"token id": bias}` as (id, bias) pairs; the ids' range is checked against the model's
    vocabulary when the turn is submitted (turns.submit)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def parse_chat(body: dict, defaults: SamplingParams, max_tokens_limit: int) -> ChatCall:
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    stream = stream_flag(body)
    options = body.get("stream_options")
    if options is not None and not stream:  # as OpenAI and vLLM answer: the options mean nothing here
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    options = options or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    thinking = body.get("enable_thinking", kwargs.get("enable_thinking"))
    if thinking is None:
        thinking = thinking_for_effort(body.get("reasoning_effort"), "reasoning_effort")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("enable_thinking must be a boolean", "enable_thinking")
    start = None
    if flag(body, "continue_final_message"):  # vLLM's extension: the reply continues the last assistant turn
        messages, start, thinking = prefill.split(messages, thinking)
    return ChatCall(messages, tools, sampling_from(body, defaults, max_tokens_limit, several=True), stream,
                    bool(options.get("include_usage")), thinking,
                    from_openai(body.get("tool_choice"), tools, body.get("parallel_tool_calls")),
                    output_format.from_openai(body.get("response_format")), prefill=start,
                    prediction=_prediction(body.get("prediction")), strict_tools=strict_names(body.get("tools")),
                    n=choices(body), template_kwargs=template_variables(kwargs, effort_level(body.get("reasoning_effort"))))


def _prediction(value) -> str | None:
    """OpenAI's predicted output: {"type": "content", "content": text or text parts}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise bad_request("prediction must be {\"type\": \"content\", \"content\": ...}", "prediction")
    return message_text(value.get("content"), "prediction.content") or None

