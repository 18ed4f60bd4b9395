"""tool_choice on both routes, as one decision: may the reply call a tool, and must it.

OpenAI: "auto" | "none" | "required" | {"type": "function", "function": {"name"}} (Responses:
{"type": "function", "name"}) | {"type": "allowed_tools", mode auto or required, tools} (chat nests
the last two keys under "allowed_tools"); Anthropic: {"type": "auto" | "any" | "tool" (with "name")
| "none"}. No tools at all means "none". The
decision becomes an engine ToolRule over token ids (the tool-call opening token masked, or a call
forced); tools stay described in the prompt under "none" so the prompt, and its cache, do not
change with the choice.

Where the reply must call a tool, or a tool is `strict`, an open call's body is also held to the
request's tools (mtplx/call_grammar.py, engine/call_rule.py): a declared name, arguments that
parse, and under "required" (or `strict`) arguments that follow the tool's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from mtplx import call_grammar
from mtplx.engine.tool_rule import ToolRule
from mtplx.server.api_error import bad_request
from mtplx.vocab import token_id

OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # "auto", "none", "required"
    name: str | None = None  # a specific tool ("required" only)
    parallel: bool = True  # more than one call in a reply (OpenAI parallel_tool_calls, Anthropic disable_parallel_tool_use)
    allowed: tuple[str, ...] | None = None  # the tools a call may name (OpenAI allowed_tools); None: any of them


def _parallel(value, param: str, invert: bool = False) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise bad_request(f"{param} must be a boolean", param)
    return value != invert


def _known(name, tools: list[dict] | None, param: str) -> str:
    names = {t["function"]["name"] for t in tools or []}
    if not isinstance(name, str) or name not in names:
        raise bad_request(f"{param} names no tool of this request: {name!r}", param)
    return name


def _named(name, tools: list[dict] | None, param: str) -> ToolChoice:
    return ToolChoice("required", _known(name, tools, param))


def _allowed(spec, tools: list[dict] | None) -> ToolChoice:
    """OpenAI's allowed_tools: calls limited to some of the request's tools (all stay described, so
    the prompt and its cache do not change with the subset), in mode auto or required."""
    param = "tool_choice.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required") or not isinstance(spec.get("tools"), list):
        raise bad_request(f"{param} needs a mode (auto or required) and a list of tools", param)
    names = []
    for entry in spec["tools"]:
        entry = entry if isinstance(entry, dict) else {}
        name = (entry.get("function") or {}).get("name") if isinstance(entry.get("function"), dict) else entry.get("name")
        names.append(_known(name, tools, f"{param}.tools"))
    if not names:
        raise bad_request(f"{param}.tools must name at least one tool", param)
    return ToolChoice(spec["mode"], allowed=tuple(dict.fromkeys(names)))


def from_openai(raw, tools: list[dict] | None, parallel=None) -> ToolChoice:
    """`parallel`: the request's parallel_tool_calls (None: absent, so allowed)."""
    parallel = _parallel(parallel, "parallel_tool_calls")
    if raw in (None, "auto"):
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if raw == "none":
        return ToolChoice("none")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if raw == "required":
        choice = ToolChoice("required")
    elif kind == "function" and isinstance(raw.get("function"), dict):
        choice = _named(raw["function"].get("name"), tools, "tool_choice.function.name")
    elif kind == "function" and "name" in raw:  # the Responses API's form
        choice = _named(raw.get("name"), tools, "tool_choice.name")
    elif kind == "allowed_tools":
        choice = _allowed(raw.get("allowed_tools", raw), tools)
    else:
        raise bad_request(f"tool_choice {raw!r} is not one of auto, none, required, a function or allowed_tools",
                          "tool_choice")
    if not tools:
        raise bad_request("tool_choice asks for a tool call but the request has no tools", "tool_choice")
    return replace(choice, parallel=parallel)


def from_anthropic(raw, tools: list[dict] | None) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice")
    if kind == "none" or (kind == "auto" and not tools):
        return ToolChoice("none")
    if not tools:
        raise bad_request("tool_choice asks for a tool call but the request has no tools", "tool_choice")
    parallel = _parallel(raw.get("disable_parallel_tool_use"), "tool_choice.disable_parallel_tool_use", invert=True)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool":
        return replace(_named(raw.get("name"), tools, "tool_choice.name"), parallel=parallel)
    return ToolChoice("auto", parallel=parallel)


class ToolRules:
    """Builds engine rules for one tokenizer (its tool-call token, blank tokens, reasoning tags)."""

    def __init__(self, tokenizer, eos_ids, tool_format=None):
        """`tool_format`: the model's (mtplx.tool_formats), whose opening tag and call head are
        steered; default the `<tool_call>` JSON family."""
        from mtplx.tool_formats import TAGGED

        self.tokenizer, self.eos_ids = tokenizer, tuple(sorted(eos_ids))
        self.format = tool_format or TAGGED
        self.open = token_id(tokenizer, self.format.start or OPEN_TAG)
        # One call only (parallel calls off) needs a call's end as one token; a format without one
        # runs free of that rule (its calls are still parsed, every one of them).
        self.close = token_id(tokenizer, self.format.end) if self.format.end else None
        from mtplx.harmony import MARKUP
        from mtplx.tool_formats import DS_CALL, DS_CALL_END, DS_SEP

        # DeepSeek's per-call delimiters and harmony's markup, as the grammar names single tokens
        self.marks = {m: f"<[{i}]>" for m in (DS_CALL, DS_SEP, DS_CALL_END, *MARKUP) if (i := token_id(tokenizer, m)) is not None}
        # formats whose call is a whole message or the whole reply (gpt-oss, Llama 3.x): a forced
        # call holds the reply to a grammar from its first token (call_rule), with no token to steer
        self.whole = self.format.name == "harmony" or self.format.body == "bare"
        if self.whole:
            self.open = self.close = None
        think = (token_id(tokenizer, "<think>"), token_id(tokenizer, "</think>"))
        self.think = think if None not in think else None
        self._blank = None
        self._grammars: dict[tuple, object] = {}  # compiled call grammars: agents resend the same tools each turn

    @property
    def blank(self) -> tuple[int, ...]:
        if self._blank is None:  # once per tokenizer: tokens that decode to whitespace only
            self._blank = tuple(i for i in range(len(self.tokenizer))
                                if (t := self.tokenizer.decode([i])) and not t.strip() and i not in self.eos_ids)
        return self._blank

    def rule(self, choice: ToolChoice, starts_in_reasoning: bool) -> ToolRule | None:
        """None when the model is free (auto, parallel calls allowed), or has no single tool-call
        token to steer."""
        if self.open is None or (choice.mode == "auto" and choice.parallel):
            return None
        if choice.mode == "none":
            return ToolRule("never", self.open)
        once = None if choice.parallel else self.close
        if choice.mode == "auto":
            return ToolRule("free", self.open, single_close=once) if once is not None else None
        head = ()
        text = self.format.call_head(choice.name) if choice.name else None
        if text:
            # In the model's own format (JSON up to the arguments' colon: the space and opening
            # brace are one token in its calls; XML up to the function tag's line).
            head = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return ToolRule("required", self.open, self.eos_ids, head, self.think, starts_in_reasoning, self.blank, once)

    def compile(self, call) -> None:
        """`call.call_grammar`: the grammar an open call's body is held to, compiled for the
        tokenizer (on a worker thread: turns.encode). None where nothing asks for one (auto without
        a strict tool or allowed_tools, none), or where the format's body or closing token is not known. A schema
        llguidance cannot take leaves that tool's arguments any JSON object, never a 400: the tool
        was accepted, and its calls still get a declared name."""
        choice = call.tool_choice
        if self.whole:  # a forced call is the whole reply (call_grammar.harmony / bare); nothing else is held
            if not call.tools or choice.mode != "required":
                return
        elif not call.tools or self.open is None or self.close is None or choice.mode == "none" or \
                (choice.mode == "auto" and not call.strict_tools and choice.allowed is None):
            return
        # allowed_tools: calls name only those (the others stay described in the prompt)
        tools = [t for t in call.tools if choice.allowed is None or call_grammar.function(t).get("name") in choice.allowed]
        enforced = tuple(call_grammar.names(tools)) if choice.mode == "required" else call.strict_tools
        key = (json.dumps(tools, sort_keys=True, default=str), choice.name, enforced, choice.parallel)
        if key not in self._grammars:
            if len(self._grammars) >= 32:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = (self._whole_reply(tools, enforced, choice.name) if self.whole
                                   else self._compiled(tools, enforced, choice.name, choice.parallel))
        call.call_grammar = self._grammars[key]

    def _whole_reply(self, tools: list[dict], enforced: tuple[str, ...], only: str | None):
        from mtplx.engine.output_rule import Grammar, ll_tokenizer

        tokenizer = ll_tokenizer(self.tokenizer, self.eos_ids)
        for kept in (enforced, ()):  # schemas first; then any JSON arguments
            text = (call_grammar.harmony(tools, self.marks, kept, only) if self.format.name == "harmony"
                    else call_grammar.bare(tools, kept, only))
            try:
                return Grammar.from_lark(text, tokenizer, self.eos_ids) if text else None
            except ValueError:
                continue
        return None

    def _compiled(self, tools: list[dict], enforced: tuple[str, ...], only: str | None, parallel: bool = True):
        from mtplx.engine.output_rule import Grammar, ll_tokenizer

        tokenizer = ll_tokenizer(self.tokenizer, self.eos_ids)
        # All schemas first; then only those that compile alone; then none (any JSON arguments).
        for kept in (list(enforced), None, []):
            if kept is None:
                kept = [name for name in enforced if self._takes(tools, name, tokenizer)]
            text = call_grammar.lark(self.format.body, tools, f"<[{self.close}]>", kept, only, self.marks, parallel)
            if text is None:
                return None
            try:
                return Grammar.from_lark(text, tokenizer, self.eos_ids)
            except ValueError:
                continue
        return None

    def _takes(self, tools: list[dict], name: str, tokenizer) -> bool:
        from mtplx.engine.output_rule import Grammar

        try:
            Grammar.from_lark(call_grammar.lark(self.format.body, tools, f"<[{self.close}]>", [name], name, self.marks),
                              tokenizer, self.eos_ids)
            return True
        except ValueError:
            return False

    def call_rule(self, call):
        """The engine rule holding a call's body to `call.call_grammar` (None: none compiled)."""
        if call.call_grammar is None:
            return None
        if self.whole:  # the whole reply, from its first token
            from mtplx.engine.output_rule import OutputRule

            return OutputRule(call.call_grammar)
        from mtplx.engine.call_rule import CallRule

        return CallRule(call.call_grammar, self.open, self.close)
