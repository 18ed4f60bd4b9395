"""Rendering conversations to tokens, and finding where complete messages end in them.

A message boundary is only an anchor if it is an *exact token prefix* of the final prompt:
rendering `messages[:k]` must give tokens that the full render starts with. Qwen3-style templates
break this in known ways (earlier reasoning dropped once a new user message arrives, consecutive
tool results merged into one user turn), so every candidate is checked and a rejected one says why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mtplx.tool_formats import TAGGED, template_iterates_arguments

@dataclass(frozen=True)
class Boundary:
    message_index: int  # boundary after messages[:message_index]
    offset: int | None  # token offset in the full prompt, None when rejected
    reason: str | None = None  # why it was rejected

    @property
    def valid(self) -> bool:
        return self.offset is not None


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
           add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> list[int]:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if template_iterates_arguments(getattr(tokenizer, "chat_template", None)):
        messages = [_arguments_as_mapping(m) for m in messages]
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False, **kwargs)
    return list(ids)


def chat_request(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, sampling=None,
                 enable_thinking: bool | None = None, prompt: list[int] | None = None, **fields):
    """The one way chat input becomes a GenerationRequest (server routes, TUI chat and replay, CLI
    generate, agents in tests and benches): the prompt rendered with the template (or `prompt`,
    when the caller rendered it already, e.g. through the server's encode cache) and the chat kept
    on the request, where the bank reads its messages and the engine its tool schemas.
    `fields`: the request's other fields (session, source, tool_rule, raw, arm, use_mtp, depth)."""
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    if prompt is None:
        prompt = render(tokenizer, messages, tools, enable_thinking=enable_thinking)
    chat = {"messages": list(messages), "tools": tools, "enable_thinking": enable_thinking}
    return GenerationRequest(tuple(prompt), sampling or SamplingParams(), chat=chat, **fields)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def message_boundaries(tokenizer, messages: list[dict], tools: list[dict] | None, prompt: list[int],
                       enable_thinking: bool | None = None) -> list[Boundary]:
    """Each complete-message end, validated as an exact token prefix of `prompt`."""
    out = []
    for k in range(1, len(messages) + 1):
        try:
            partial = render(tokenizer, messages[:k], tools, add_generation_prompt=False, enable_thinking=enable_thinking)
        except Exception as exc:  # a template may refuse a partial conversation (e.g. no user turn yet)
            out.append(Boundary(k, None, f"template cannot render messages[:{k}]: {type(exc).__name__}"))
            continue
        same = common_prefix(partial, prompt)
        if same == len(partial) and len(partial) <= len(prompt):
            out.append(Boundary(k, len(partial)))
        else:
            out.append(Boundary(k, None, f"rendering messages[:{k}] differs from the prompt at token {same} of {len(partial)}"))
    return out


def head_end(tokenizer, prompt: list[int], markers=None) -> int | None:
    """End of the leading system turn (system prompt + tools) found from the template's turn
    markers, or None. Pass `markers` when calling per prompt: finding them renders probe chats."""
    from mtplx.bank.anchors import Markers, head_end as head_of, turn_ends

    markers = markers or Markers.from_tokenizer(tokenizer)
    return head_of(prompt, markers, turn_ends(prompt, markers))


def _arguments_as_mapping(message: dict) -> dict:
    """A message whose tool-call arguments (JSON strings, as OpenAI clients send them) are parsed
    into mappings, for templates that iterate them; text that is not a JSON object stays as is."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}


def parse_reply(text: str, tool_format=None, tools: list | None = None) -> dict:
    """An assistant output as the message a client sends back: reasoning, content, tool calls.

    `tool_format` is the model's (default: the `<tool_call>` family, JSON or XML bodies). Tool calls
    that do not parse stay in the content (a client would show them as text)."""
    fmt = tool_format or TAGGED
    reasoning = None
    if "</think>" in text:
        head, text = text.split("</think>", 1)
        reasoning = head.split("<think>", 1)[-1].strip("\n")
    calls, content = [], text
    end = re.escape(fmt.end) if fmt.end else r"\Z"
    for found in re.finditer(re.escape(fmt.start) + r"(.*?)" + end, text, re.S):
        try:
            parsed = fmt.parse(found.group(1), tools)
        except Exception:  # a parser's own failure: the text stays content
            continue
        for call in parsed:
            calls.append({"id": f"call_{len(calls)}", "type": "function",
                          "function": {"name": call.name, "arguments": fmt.arguments_json(call)}})
        content = content.replace(found.group(0), "")
    message = {"role": "assistant", "content": content.strip()}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
