"""The grammar of a tool call's body: a call to one of the request's tools, as the model's format
writes it, its arguments held to the tool's JSON schema.

Small local models call tools that were never offered (`write_file` for `write`), or write
arguments that are not JSON; the agent then spends a turn on the error. Once a call has opened,
the engine (engine/call_rule.py) holds its body to this grammar, so the name is a declared tool's
and the arguments parse (and, where the schema is enforced, validate).

The text between the opening tag and the closing token, for the `<tool_call>` family:
- JSON (Qwen3, Hermes, the embedded models): `\\n{"name": "N", "arguments": {...}}\\n`;
- XML (Qwen3.5, Qwen3-Coder): `\\n<function=N>\\n<parameter=K>\\nvalue\\n</parameter>\\n...</function>\\n`;
  keys are the tool's properties (any key when the schema lets others in), values are free text up
  to `\\n</parameter>` (their types are not enforced: the template writes them as text).
DeepSeek's calls block (the text between `<｜tool▁calls▁begin｜>` and its closing token):
- V3.1 ("plain"): `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`, one after another;
- V3 ("fenced"): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜>`;
  the delimiters are single tokens (`marks` names each as the grammar's `<[id]>`), and a block
  holds one call when parallel calls are off.
gpt-oss (harmony) has no call delimiters: a call is a message, so a forced call holds the whole
reply (`harmony`): an optional analysis message, then
`<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}`, then the end of the turn.
Llama 3.x's call is the reply too (`bare`): `{"name": "N", "parameters": {...}}`.
Other formats get no grammar: their bodies are read by mlx-lm's parsers, whose syntax is theirs.

The output is llguidance's Lark dialect; `close` is how the grammar names the closing token
(`<[id]>`). This module knows text and JSON schemas, never tokens or requests.
"""

from __future__ import annotations

import json
from typing import Collection

# The same fixed separators as the template's `tojson` (and structured output's documents): with
# free whitespace a model can pad with newlines until its budget ends, and small ones do.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
ANY_OBJECT = {"type": "object"}


def function(tool: dict) -> dict:
    return tool.get("function", tool) if isinstance(tool, dict) else {}


def names(tools: list[dict]) -> list[str]:
    return [function(t)["name"] for t in tools if isinstance(function(t).get("name"), str)]


def schema_of(tool: dict) -> dict:
    schema = function(tool).get("parameters")
    return schema if isinstance(schema, dict) and schema else ANY_OBJECT


def lark(body: str, tools: list[dict], close: str, enforced: Collection[str] = (), only: str | None = None,
         marks: dict[str, str] | None = None, parallel: bool = True) -> str | None:
    """The grammar of one call's body, or None for a body layout it does not know. `enforced`: the
    tools whose arguments must follow their schema (the others: any JSON object); `only`: the one
    tool the call must be to (a named tool choice); `marks`: a DeepSeek delimiter's text -> its
    token in the grammar; `parallel`: whether a DeepSeek block may hold several calls."""
    chosen = _chosen(tools, only)
    if not chosen or body not in ("json", "xml", "plain", "fenced"):
        return None
    if body in ("plain", "fenced"):
        return _deepseek(body, chosen, close, enforced, marks or {}, parallel)
    rules = [f"start: {_literal(chr(10))} call {_literal(chr(10))} {close}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        name = function(tool)["name"]
        schema = schema_of(tool) if name in enforced else ANY_OBJECT
        rules += _json_call(i, name, schema) if body == "json" else _xml_call(i, name, schema)
    if body == "xml":
        # A value runs to the first "\n</parameter>" (lazy: it cannot hold that text itself).
        rules += ['value[lazy]: VALUE_TEXT "\\n</parameter>"', "VALUE_TEXT: /(.|\\n)*/", "ANY_KEY: /[^>\\s]+/"]
    return "\n".join(rules) + "\n"


def bare(tools: list[dict], enforced: Collection[str] = (), only: str | None = None) -> str | None:
    """The grammar of a whole Llama 3.x reply that must call one of `tools` (`only`: that one)."""
    chosen = _chosen(tools, only)
    if not chosen:
        return None
    rules = ["start: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        name = function(tool)["name"]
        schema = schema_of(tool) if name in enforced else ANY_OBJECT
        document = json.dumps(schema | {"x-guidance": JSON_OPTIONS}, ensure_ascii=False)
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '
        rules += [f'call_{i}: {_literal(head)} args_{i} "}}"', f"args_{i}: %json {document}"]
    return "\n".join(rules) + "\n"


def harmony(tools: list[dict], marks: dict[str, str], enforced: Collection[str] = (), only: str | None = None) -> str | None:
    """The grammar of a whole gpt-oss reply that must call one of `tools` (`only`: that one):
    `marks` names harmony's tokens (`<|channel|>`, ...) as the grammar's `<[id]>`."""
    from mtplx.harmony import CHANNEL, CONSTRAIN, END, MESSAGE, START

    chosen = _chosen(tools, only)
    if not chosen or any(marks.get(m) is None for m in (CHANNEL, CONSTRAIN, END, MESSAGE, START)):
        return None
    rules = ["start: analysis? call",
             f"analysis: {marks[CHANNEL]} {_literal('analysis')} {marks[MESSAGE]} THOUGHT {marks[END]} "
             f"{marks[START]} {_literal('assistant')}",
             "THOUGHT: /(.|\n)*/",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        name = function(tool)["name"]
        schema = schema_of(tool) if name in enforced else ANY_OBJECT
        document = json.dumps(schema | {"x-guidance": JSON_OPTIONS}, ensure_ascii=False)
        rules += [f"call_{i}: {marks[CHANNEL]} {_literal('commentary to=functions.' + name + ' ')} {marks[CONSTRAIN]} "
                  f"{_literal('json')} {marks[MESSAGE]} args_{i}",
                  f"args_{i}: %json {document}"]
    return "\n".join(rules) + "\n"


def _deepseek(body: str, chosen: list[dict], close: str, enforced: Collection[str], marks: dict[str, str],
              parallel: bool) -> str | None:
    from mtplx.tool_formats import DS_CALL, DS_CALL_END, DS_SEP

    if any(marks.get(m) is None for m in (DS_CALL, DS_SEP, DS_CALL_END)):
        return None  # a vocabulary without these as single tokens: its calls run free
    rules = [f"start: {'call+' if parallel else 'call'} {close}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        name = function(tool)["name"]
        schema = schema_of(tool) if name in enforced else ANY_OBJECT
        document = json.dumps(schema | {"x-guidance": JSON_OPTIONS}, ensure_ascii=False)
        if body == "plain":
            head, tail = f"{_literal(name)} {marks[DS_SEP]}", ""
        else:
            head, tail = f"{_literal('function')} {marks[DS_SEP]} {_literal(name + chr(10) + '```json' + chr(10))}", \
                _literal(chr(10) + "```")
        rules += [f"call_{i}: {marks[DS_CALL]} {head} args_{i} {tail} {marks[DS_CALL_END]}",
                  f"args_{i}: %json {document}"]
    return "\n".join(rules) + "\n"


def _json_call(i: int, name: str, schema: dict) -> list[str]:
    head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    document = json.dumps(schema | {"x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    return [f'call_{i}: {_literal(head)} args_{i} "}}"', f"args_{i}: %json {document}"]


def _xml_call(i: int, name: str, schema: dict) -> list[str]:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    keys = [k for k in properties if isinstance(k, str) and k and not any(c in k for c in "> \t\n")]
    head, tail = _literal(f"<function={name}>" + chr(10)), _literal("</function>")
    # An enforced schema lists what a call may hold, unless it lets other keys in: then each of its
    # parameters comes at most once, in the schema's order (as llguidance orders a JSON object's
    # properties), the required ones always. A value is text; one the schema types otherwise
    # (integer, boolean, object, ...) is JSON of its own schema, as the parser reads it
    # (tool_formats._xml_arguments).
    if not keys or schema.get("additionalProperties") not in (None, False):
        return [f"call_{i}: {head} param_{i}* {tail}",
                f"param_{i}: {_literal('<parameter=')} ANY_KEY {_literal('>' + chr(10))} value {_literal(chr(10))}"]
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    rules, params = [], []
    for j, key in enumerate(keys):
        spec = properties[key] if isinstance(properties[key], dict) else {}
        value = "value"
        if spec.get("type") not in (None, "string"):
            rules.append(f"json_{i}_{j}: %json {json.dumps(spec | {'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}")
            value = f'json_{i}_{j} "\\n</parameter>"'
        rules.append(f"param_{i}_{j}: {_literal(f'<parameter={key}>' + chr(10))} {value} {_literal(chr(10))}")
        params.append(f"param_{i}_{j}" + ("" if key in required else "?"))
    return [f"call_{i}: {head} {' '.join(params)} {tail}"] + rules


def _chosen(tools: list[dict], only: str | None) -> list[dict]:
    """The tools a call may be to: `only` (a named tool choice), else every named one."""
    return [t for t in tools if isinstance(function(t).get("name"), str) and (not only or function(t)["name"] == only)]


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
