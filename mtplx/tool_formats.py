"""Tool-call formats: how a model writes a tool call, and how to read one back.

A format is a pair of delimiters and a body parser. The `<tool_call>` family is read here: a JSON
object (Qwen3, Hermes, the embedded models), Qwen3.5 / Qwen3-Coder XML
(`<function=name><parameter=k>v</parameter></function>`), GLM `<arg_key>` pairs; the body decides
which, so a stream needs no knowledge of the model for them. DeepSeek's calls (V3, V3.1) are read
here too, and V3.2's DSML calls: mlx-lm has no parser for them. The other formats mlx-lm's tokenizer wrapper recognises (Mistral `[TOOL_CALLS]`, pythonic, Kimi, MiniMax, Gemma, LongCat, ...) use
mlx-lm's own parser for the body, imported only when such a model is loaded.

This module knows text and JSON, never tokens, arrays or requests.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import weakref
from dataclasses import dataclass, replace
from typing import Callable

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict | str  # a mapping, or the model's text when it is not one


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str  # "" when a call runs to the end of the output
    parse_body: Callable[[str, list | None], list[ToolCall]]
    body: str = ""  # how the template writes a call's body: "json" or "xml" (`<tool_call>`), "plain" or
    # "fenced" (DeepSeek V3.1 / V3), "bare" (Llama 3.x: the reply is the JSON call), "" when not known
    # Tokens inside a call its parser reads, kept in the reply's text even where the tokenizer marks
    # them special (engine/text_stream.py): Mistral's [ARGS], Kimi's per-call tags, harmony's headers.
    markup: tuple[str, ...] = ()

    def call_head(self, name: str) -> str | None:
        """The text a call of tool `name` starts with right after the opening tag, up to its
        arguments (what forcing a named tool pins), or None when the format's head is not known."""
        if self.body == "json":
            return f'\n{{"name": "{name}", "arguments":'
        if self.body == "xml":
            return f"\n<function={name}>\n"
        if self.body == "plain":
            return f"{DS_CALL}{name}{DS_SEP}"
        if self.body == "fenced":
            return f"{DS_CALL}function{DS_SEP}{name}\n```json\n"
        return None

    def parse(self, body: str, tools: list | None = None) -> list[ToolCall]:
        """The calls in the text between the delimiters; ValueError when it holds none."""
        calls = self.parse_body(body, tools)
        if not calls:
            raise ValueError("no tool call")
        return calls

    def arguments_json(self, call: ToolCall) -> str:
        return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)


def _tagged_body(body: str, tools: list | None) -> list[ToolCall]:
    text = body.strip()
    if text.startswith("{"):
        call = json.loads(text)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("a JSON tool call needs a string 'name'")
        args = call.get("arguments", call.get("parameters", {}))
        return [ToolCall(call["name"], args if isinstance(args, (dict, str)) else json.dumps(args))]
    if "<function=" in text:
        return [ToolCall(name, _xml_arguments(name, inner, tools)) for name, inner in _FUNCTION.findall(text)]
    if "<arg_key>" in text:
        return _delegated("glm47")(body, tools)
    raise ValueError("neither a JSON object nor a <function=...> block")


def _xml_arguments(name: str, inner: str, tools: list | None) -> dict:
    """Parameter values are text. Only a tool schema that types a parameter as something else
    (integer, boolean, object, ...) makes the text be read as JSON, as Qwen's own parser does:
    without one, text stays text, so sending the call back re-renders exactly what the model wrote
    (`true` would come back from the template as `True`, `1.50` as `1.5`)."""
    schema = _properties(name, tools)
    out = {}
    for key, value in _PARAMETER.findall(inner):
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        kind = str((schema.get(key) or {}).get("type", "string")).lower()
        if kind not in ("string", "str", "text", "enum"):
            try:
                out[key] = json.loads(value)
                continue
            except json.JSONDecodeError:
                pass
        out[key] = value
    return out


def _properties(name: str, tools: list | None) -> dict:
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            return (fn.get("parameters") or fn.get("input_schema") or {}).get("properties") or {}
    return {}


# DeepSeek's delimiters: one tokenizer token each in its vocabulary.
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_ONE = re.compile(re.escape(DS_CALL) + "(.*?)" + re.escape(DS_SEP) + "(.*?)" + re.escape(DS_CALL_END), re.S)
_FENCED = re.compile(r"^([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.S)


def _deepseek_body(body: str, tools: list | None) -> list[ToolCall]:
    """Every call in a DeepSeek calls block. V3.1 writes `NAME<sep>ARGS`; V3 writes
    `function<sep>NAME` and the arguments in a ```json fence. The arguments are kept as the text
    the model wrote whenever it is a JSON object: DeepSeek's templates write a sent-back call's
    arguments string verbatim, so the history then renders exactly what was generated."""
    calls = []
    for head, rest in _DS_ONE.findall(body):
        fenced = _FENCED.match(rest)
        if head.strip() == "function" and fenced:
            name, args = fenced.group(1).strip(), fenced.group(2).strip()
        else:
            name, args = head.strip(), rest.strip()
        if not name:
            raise ValueError("a DeepSeek tool call without a name")
        if not isinstance(json.loads(args), dict):
            raise ValueError("DeepSeek tool-call arguments that are not a JSON object")
        calls.append(ToolCall(name, args))
    return calls


def _delegated(module_name: str) -> Callable[[str, list | None], list[ToolCall]]:
    def parse(body: str, tools: list | None) -> list[ToolCall]:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
        found = module.parse_tool_call(body, tools)
        found = found if isinstance(found, list) else [found]
        out = []
        for call in found:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"{module_name} parser returned {call!r}")
            args = call.get("arguments", {})
            out.append(ToolCall(call["name"], args if isinstance(args, (dict, str)) else json.dumps(args)))
        return out

    return parse


TAGGED = ToolFormat("tool_call", "<tool_call>", "</tool_call>", _tagged_body, "json")

# mlx-lm parser module -> its delimiters (the values its modules define).
_OTHERS = {
    "mistral": ("[TOOL_CALLS]", ""),
    "pythonic": ("<|tool_call_start|>", "<|tool_call_end|>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    "kimi_k3": ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "gemma4": ("<|tool_call>", "<tool_call|>"),
    "function_gemma": ("<start_function_call>", "<end_function_call>"),
    "longcat": ("<longcat_tool_call>", "</longcat_tool_call>"),
    "minicpm5": ("<function name=", "</function>"),
    "muse_spark": ("<atem:function_calls>", "</atem:function_calls>"),
}
DEEPSEEK = ToolFormat("deepseek", DS_CALLS, DS_CALLS_END, _deepseek_body, "plain", (DS_CALL, DS_SEP, DS_CALL_END))


def _harmony_body(body: str, tools: list | None) -> list[ToolCall]:
    raise ValueError("harmony calls are read from message headers (mtplx/harmony.py), not a delimited body")


# gpt-oss: a call is a message whose header names its recipient; no delimiters (harmony.py reads it)
HARMONY = ToolFormat("harmony", "", "", _harmony_body,
                     markup=("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"))


def _bare_json_body(body: str, tools: list | None) -> list[ToolCall]:
    """Llama 3.x's calls: a reply that is a JSON object {"name", "parameters"} (or "arguments"),
    or several separated by ";", after an optional `<|python_tag|>`."""
    decoder, text, at, calls = json.JSONDecoder(), body.strip(), 0, []
    while at < len(text):
        call, at = decoder.raw_decode(text, at)
        args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
            raise ValueError("a Llama call is a JSON object with a string 'name' and object 'parameters'")
        calls.append(ToolCall(call["name"], args))
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    return calls


DSML = "｜DSML｜"
DSML_CALLS, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*?)</{DSML}invoke>', re.S)
_DSML_PARAMETER = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</{DSML}parameter>', re.S)


def _dsml_body(body: str, tools: list | None) -> list[ToolCall]:
    """DeepSeek-V3.2's calls: `<DSML invoke name="NAME">` blocks of `<DSML parameter name="K"
    string="true|false">V</DSML parameter>`. A string="true" value is the text as written (its
    encoder writes strings unquoted and unescaped); any other is JSON, kept as its text when it is
    not (the call is the model's; a value it got wrong is still its value)."""
    calls = []
    for name, inner in _INVOKE.findall(body):
        if not name.strip():
            raise ValueError("a DSML invoke without a name")
        arguments = {}
        for key, string, value in _DSML_PARAMETER.findall(inner):
            if string == "true":
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                arguments[key] = value
        calls.append(ToolCall(name.strip(), arguments))
    return calls


# DeepSeek-V3.2: its calls block is text (no special tokens), read here (mlx-lm has no parser for it)
DSML_FORMAT = ToolFormat("dsml", DSML_CALLS, DSML_CALLS_END, _dsml_body)


# Llama 3.1 / 3.2 / 3.3: a reply that opens with "{" is a call (reply_stream.py holds it to the end);
# `<|python_tag|>` opens one too (the built-in tools' form).
LLAMA_JSON = ToolFormat("llama3_json", "<|python_tag|>", "", _bare_json_body, "bare")
# what the delegated parsers read inside a call besides its delimiters
_INNER = {"mistral": ("[ARGS]",), "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"),
          "function_gemma": ("<escape>",)}
FORMATS = {"tool_call": TAGGED, "deepseek": DEEPSEEK, "dsml": DSML_FORMAT, "harmony": HARMONY, "llama3_json": LLAMA_JSON,
           **{name: ToolFormat(name, s, e, _delegated(name), markup=_INNER.get(name, ())) for name, (s, e) in _OTHERS.items()}}
# mlx-lm names the `<tool_call>` bodies separately; they are one format here (any body parses),
# remembering which body the template writes.
_FAMILY = {"json_tools": "json", "qwen3_coder": "xml", "glm47": "glm", "laguna": "glm"}


def by_name(name: str) -> ToolFormat:
    if name in _FAMILY:
        return TAGGED if _FAMILY[name] == "json" else ToolFormat("tool_call", TAGGED.start, TAGGED.end,
                                                                 _tagged_body, _FAMILY[name])
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r} (known: {', '.join(sorted(FORMATS))})")
    if name in _OTHERS:  # the delimiters must still match the installed mlx-lm's
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        fmt = FORMATS[name]
        if (module.tool_call_start, module.tool_call_end) != (fmt.start, fmt.end):
            return ToolFormat(name, module.tool_call_start, module.tool_call_end, fmt.parse_body, markup=fmt.markup)
    return FORMATS[name]


def detect(tokenizer) -> ToolFormat | None:
    """The format mlx-lm's tokenizer wrapper chose from the model's template or vocabulary, or
    DeepSeek's, which mlx-lm does not know: named by the template or, for a template that writes no
    calls (V3.1's official one), by the vocabulary's calls token."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if not module.startswith("mlx_lm.tool_parsers."):
        from mtplx.harmony import is_harmony  # (it imports this module)

        return (dsml_format(tokenizer) or deepseek_format(tokenizer) or (HARMONY if is_harmony(tokenizer) else None)
                or llama_format(tokenizer))
    try:
        return by_name(module.rsplit(".", 1)[1])
    except ValueError:
        return None


_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def format_of(tokenizer) -> ToolFormat:
    """The format a tokenizer's model writes calls in (`detect`; the `<tool_call>` family when none
    is recognised), looked up once per tokenizer: callers on the engine thread ask per reply."""
    try:
        return _OF[tokenizer]
    except (KeyError, TypeError):
        pass
    fmt = detect(tokenizer) or TAGGED
    try:
        _OF[tokenizer] = fmt
    except TypeError:
        pass
    return fmt


def dsml_format(tokenizer) -> ToolFormat | None:
    """DeepSeek-V3.2's calls: named by mlx-lm's Python renderer for it, or a template that writes
    them (its vocabulary still holds V3's call tokens, so this is asked first)."""
    from mtplx import chat_template

    if chat_template.renderer_name(tokenizer) == "deepseek_v32" or DSML in (chat_template.text(tokenizer) or ""):
        return DSML_FORMAT
    return None


def llama_format(tokenizer) -> ToolFormat | None:
    """Llama 3.1's calls, named by its template: the JSON form it asks for, or its python tag."""
    from mtplx import chat_template

    template = chat_template.text(tokenizer) or ""
    if "<|python_tag|>" in template or "dictionary of argument name and its value" in template:
        return LLAMA_JSON
    return None


def deepseek_format(tokenizer) -> ToolFormat | None:
    from mtplx import chat_template

    template = chat_template.text(tokenizer) or ""
    if DS_CALLS not in template:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if DS_CALLS not in vocab or DS_CALL not in vocab:
            return None
    # The original V3 template fences the arguments after a `function` type; V3.1 and later do not.
    fenced = "```json" in template and "tool['type']" in template
    return replace(DEEPSEEK, body="fenced") if fenced else DEEPSEEK


@functools.lru_cache(maxsize=16)  # asked on every render; a template is a few KB of text
def template_iterates_arguments(template: str | None) -> bool:
    """Whether a chat template walks tool-call arguments as a mapping (Qwen3.5 / Qwen3-Coder:
    `arguments|items`), or serialises them with `tojson` without first asking whether they are a
    string already (gpt-oss, Llama 3.1: a JSON string would render quoted, `"{\"path\": ...}"`), so
    arguments sent as a JSON string must reach it parsed."""
    if not template:
        return False
    if re.search(r"arguments\s*\|\s*items|arguments\.items\(\)", template):
        return True
    return bool(re.search(r"arguments\s*\|\s*tojson", template)) and not re.search(r"arguments\s+is\s+string", template)


@functools.lru_cache(maxsize=16)  # asked on every render; a template is a few KB of text
def template_reads_thinking_switch(template: str | None) -> bool:
    """Whether a chat template turns reasoning on with a plain `thinking` variable (DeepSeek V3.1:
    `{% if thinking %}<think>...`) rather than `enable_thinking`."""
    return bool(template) and "enable_thinking" not in template and \
        bool(re.search(r"(?<![\w.'\"\[])thinking\s+is\s+defined|\{%-?\s*if\s+(not\s+)?thinking\b", template))


@functools.lru_cache(maxsize=16)  # asked on every render; a template is a few KB of text
def template_reads_thinking(template: str | None) -> bool:
    """Whether a chat template takes an assistant turn's reasoning as `thinking` (gpt-oss) rather
    than `reasoning_content`: reasoning sent back under the OpenAI name is then renamed for it."""
    return bool(template) and bool(re.search(r"\.thinking\b|\[['\"]thinking['\"]\]", template)) \
        and "reasoning_content" not in template
