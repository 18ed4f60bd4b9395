"""Tools described in the system prompt, for a chat template that does not render them.

Several real templates drop the `tools` a request carries: DeepSeek-V3.1's official one (DeepSeek
documents a system-prompt section for them instead), V3's, Llama 3.0's, Gemma 3's. Rendered as
they are, an agent's request reaches the model without its tools, and the model never calls one.
When rendering a request's tools changes nothing in the prompt, mtplx writes the section itself,
after the system prompt: each tool's name, description and parameter schema, and the call syntax
of the model's own format (tool_formats.py), the one its replies are parsed with. DeepSeek's
section keeps the headings its model card documents; the `<tool_call>` family's is the JSON form
the embedded models use.

The section is a function of the tools alone, so every render of a conversation (each message
boundary the bank checks, each turn of a session) carries the same text, and the head anchor
(system prompt + tools) still restores across turns.

This module knows messages, tools and templates' output, never arrays or requests.
"""

from __future__ import annotations

import json
import logging
import weakref

from mtplx import tool_formats
from mtplx.call_grammar import function

log = logging.getLogger(__name__)
_PROBE_TOOL = {"type": "function", "function": {"name": "mtplx_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> (renders tools, format)
YES, WITH_SYSTEM, NO = "yes", "with a system message", "no"  # whether a template renders a request's tools


def described(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools described in the system prompt when the template ignores
    `tools` and the model's call format is one this module can describe; with an empty system
    message first when the template writes tools only after one (DeepSeek-V3.2's encoder);
    else `messages`."""
    if not tools:
        return messages
    renders, fmt = _facts(tokenizer)
    first = messages[0] if messages else None
    if renders == WITH_SYSTEM:
        has_system = isinstance(first, dict) and first.get("role") in ("system", "developer")
        return messages if has_system else [{"role": "system", "content": ""}, *messages]
    if renders == YES or fmt is None:
        return messages
    text = section(fmt, tools)
    if isinstance(first, dict) and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
        if isinstance(content, list):
            return [{**first, "content": [*content, {"type": "text", "text": f"\n\n{text}"}]}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def section(fmt: tool_formats.ToolFormat, tools: list[dict]) -> str:
    """The system-prompt text describing `tools` and how `fmt` writes a call."""
    listed = [function(t) for t in tools if isinstance(function(t).get("name"), str)]
    if fmt.name == "deepseek":
        return _deepseek(fmt, listed)
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in listed)
    return ("# Tools\n\nYou may call the functions below to help with the user's request. Their "
            "signatures, one JSON object per line:\n<tools>\n" + lines + "\n</tools>\n\n"
            "To call one, write its name and arguments as a JSON object inside <tool_call></tool_call> "
            "tags, one call per pair of tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


def _deepseek(fmt: tool_formats.ToolFormat, listed: list[dict]) -> str:
    from mtplx.tool_formats import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP

    blocks = []
    for f in listed:
        parameters = f.get("parameters") if isinstance(f.get("parameters"), dict) else {"type": "object"}
        blocks.append(f"### {f['name']}\nDescription: {f.get('description') or ''}\n\n"
                      f"Parameters: {json.dumps(parameters, ensure_ascii=False)}")
    one = (f"{DS_CALL}function{DS_SEP}tool_call_name\n```json\ntool_call_arguments\n```{DS_CALL_END}"
           if fmt.body == "fenced" else f"{DS_CALL}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}")
    return ("## Tools\nYou have access to the following tools:\n\n" + "\n\n".join(blocks) +
            "\n\nTo use tools, write the calls in exactly this form:\n"
            f"{DS_CALLS}{one}{{{{additional_tool_calls}}}}{DS_CALLS_END}\n\n"
            "Where:\n- `tool_call_name` is exactly the name of one of the tools above\n"
            "- `tool_call_arguments` is a JSON object that follows that tool's Parameters schema\n"
            "- further calls follow the first directly, with no separator, before the closing token")


def _facts(tokenizer) -> tuple[str, tool_formats.ToolFormat | None]:
    """Whether the template renders tools, and the format to describe them in when it does not
    (the model's own; the `<tool_call>` JSON form when the model has none), once per tokenizer."""
    try:
        return _SEEN[tokenizer]
    except (KeyError, TypeError):
        pass
    facts = (_renders_tools(tokenizer), None)
    if facts[0] == NO:
        fmt = tool_formats.format_of(tokenizer)
        describable = fmt.name == "deepseek" or fmt.body == "json"
        facts = (NO, fmt if describable else None)
        if describable:
            log.info("this chat template does not render tools: mtplx describes them in the system prompt (%s)",
                     fmt.name)
        else:
            log.warning("this chat template does not render tools, and mtplx cannot describe tools for the %r "
                        "call format: the model will not see them", fmt.name)
    try:
        _SEEN[tokenizer] = facts
    except TypeError:
        pass
    return facts


def _renders_tools(tokenizer) -> str:
    user = {"role": "user", "content": "hi"}
    for chat, answer in (([user], YES), ([{"role": "system", "content": "be brief"}, user], WITH_SYSTEM)):
        try:
            bare = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            with_tool = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        except Exception:  # a template that cannot render this probe: as it answered the one before
            return YES if answer == YES else NO
        if bare != with_tool:
            return answer
    return NO
