"""The turn structure of a tokenizer's chat template, found once by probing the template.

Templates differ in the special token that opens a turn (`<|im_start|>`, `<|start_header_id|>`,
`<start_of_turn>`) and the one that closes it (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), in
whether a newline follows the close, and in how messages map to turns: Gemma folds the system
message into the first user turn, Qwen wraps a run of tool results in one user turn, Llama 3.1
adds a system turn of its own. Rendering a few probe conversations with sentinel contents and
reading where the sentinels land tells all of that without knowing the template. Only the
structure is kept (ids and flags); the planner never sees text.

DeepSeek-style templates have no open/close turns: a token per role opens a message
(`<｜User｜>`, `<｜Assistant｜>`, `<｜tool▁outputs▁begin｜>`), nothing closes a user's, and the system
prompt is bare text after BOS. `probe_roles` reads those: each role's opener is the run of template
tokens before its content less the previous message's closing run, and a message whose opener is
empty (DeepSeek's reply after tool outputs) starts right after that closing run. The result is
checked on the probe conversations themselves; a template read wrongly gets no markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mtplx.vocab import token_id

# Sentinel contents: plain words no template rewrites (trim, escaping) and no probe repeats.
_SENT = ["qzxsentinel%d" % i for i in range(8)]


@dataclass(frozen=True)
class Markers:
    """Token ids of a template's turn structure (None where it has none)."""

    turn_start: int | None
    turn_end: int | None
    newline: int | None  # the token a template puts between a turn's close and the next open
    system: tuple[int, ...] = ()  # what follows `turn_start` in a system turn's header
    system_merged: bool = False  # the system message shares the first user turn (Gemma)
    tools_merged: bool = True  # consecutive tool results share one turn (Qwen, ChatML)
    lead: int = 0  # turns the template adds before the first message when there is no system one
    # Role-token templates (turn_start and turn_end None): a message's span starts at one of `opens`,
    # except the second of a `joined` pair (one opening: DeepSeek's tool-outputs begin + output begin),
    # or right after one of `after` (a closing token with no opener behind it).
    opens: tuple[int, ...] = ()
    joined: tuple[tuple[int, int], ...] = ()
    after: tuple[int, ...] = ()
    system_bare: bool = False  # the system prompt is text before the first opener, in no turn of its own
    preamble: int = 0  # tokens before the first opener when there is no system message (BOS)

    @property
    def roles(self) -> bool:
        return bool(self.opens)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Markers":
        """Probe the tokenizer's chat template: open/close turns, else role tokens; ChatML's tokens
        where it has no usable template."""
        for find in (probe, probe_roles):
            try:
                found = find(tokenizer)
            except Exception:  # a template that refuses the probe (or none at all)
                found = None
            if found:
                return found
        return chatml(tokenizer)


def chatml(tokenizer) -> Markers:
    nl = tokenizer.encode("\n", add_special_tokens=False)
    return Markers(token_id(tokenizer, "<|im_start|>"), token_id(tokenizer, "<|im_end|>"), nl[0] if len(nl) == 1 else None,
                   tuple(tokenizer.encode("system", add_special_tokens=False)))


def _text(tokenizer, messages, **kwargs) -> str:
    from mtplx import chat_template

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             **chat_template.variables(tokenizer, kwargs))
    except Exception:
        if "enable_thinking" in kwargs:
            raise
        # DeepSeek-V3.2's encoder, reasoning by default, refuses a reply after the last user message
        # that carries no reasoning (a probe's): its turn structure is the same with reasoning off.
        return _text(tokenizer, messages, enable_thinking=False, **kwargs)


def _specials(tokenizer) -> dict[str, int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: i for i, t in decoder.items() if getattr(t, "special", False) and len(t.content) > 1}


def probe(tokenizer) -> Markers | None:
    """The turn markers of `tokenizer`'s template, or None when its structure is not open/close turns."""
    specials = _specials(tokenizer)
    if not specials:
        return None
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    s0, u1, a2, u3 = _SENT[:4]
    text = _text(tokenizer, [{"role": "system", "content": s0}, {"role": "user", "content": u1},
                             {"role": "assistant", "content": a2}, {"role": "user", "content": u3}])
    hits = [(m.start(), m.end(), m.group()) for m in pattern.finditer(text)]
    after_user = text.index(u1) + len(u1)
    close = next(h for h in hits if h[0] >= after_user)  # the first special after a user's content
    opened = next(h for h in hits if h[0] >= close[1])  # and the first one after that close
    start, end = opened[2], close[2]
    if start == end:
        return None
    between = text[close[1]:opened[0]]
    nl = tokenizer.encode(between, add_special_tokens=False) if between else []
    if len(nl) > 1:
        return None

    def turn_of(rendered: str, sentinel: str) -> int:
        return rendered.count(start, 0, rendered.index(sentinel)) - 1

    # Open/close turns put each of these in the turn after the previous one; templates whose roles
    # are tokens with no closing one (DeepSeek's `<｜User｜>`/`<｜Assistant｜>`) fail this.
    if not 0 <= turn_of(text, u1) == turn_of(text, a2) - 1 == turn_of(text, u3) - 2:
        return None
    system_merged = turn_of(text, s0) == turn_of(text, u1)
    system: tuple[int, ...] = ()
    if not system_merged:  # the system turn's header: from the opener to the first newline or special
        head_start = text.rfind(start, 0, text.index(s0)) + len(start)
        stop = min([p for p in (text.find("\n", head_start), *(h[0] for h in hits if h[0] >= head_start)) if p >= 0])
        system = tuple(tokenizer.encode(text[head_start:stop], add_special_tokens=False))
    plain = _text(tokenizer, [{"role": "user", "content": u1}, {"role": "assistant", "content": a2}])
    lead = turn_of(plain, u1)
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    try:  # templates without tool turns (Gemma) refuse this; their tool runs cannot occur
        tools = _text(tokenizer, [{"role": "user", "content": u1}, {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "call_0", "content": _SENT[4]},
                                  {"role": "tool", "tool_call_id": "call_0", "content": _SENT[5]}])
        tools_merged = turn_of(tools, _SENT[4]) == turn_of(tools, _SENT[5])
    except Exception:
        tools_merged = False
    return Markers(specials[start], specials[end], nl[0] if nl else None, system, system_merged, tools_merged, lead)


def _added(tokenizer) -> dict[str, int]:
    """Every added token (DeepSeek's role tokens are added but not marked special)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: i for i, t in decoder.items() if len(t.content) > 1}


class _Runs:
    """A rendered probe: the runs of adjacent template tokens just before and after a sentinel."""

    def __init__(self, text: str, pattern: re.Pattern, ids: dict[str, int]):
        self.text, self.ids = text, ids
        hits = [(m.start(), m.end(), m.group()) for m in pattern.finditer(text)]
        self.ending = {e: (s, g) for s, e, g in hits}
        self.starting = {s: (e, g) for s, e, g in hits}

    def before(self, sentinel: str) -> list[int]:
        out, at = [], self.text.index(sentinel)
        while at in self.ending:
            at, token = self.ending[at]
            out.insert(0, self.ids[token])
        return out

    def after(self, sentinel: str) -> list[int]:
        out, at = [], self.text.index(sentinel) + len(sentinel)
        while at in self.starting:
            at, token = self.starting[at]
            out.append(self.ids[token])
        return out


def probe_roles(tokenizer) -> Markers | None:
    """The role tokens of `tokenizer`'s template, or None when it has none a message can be found by."""
    ids = _added(tokenizer)
    if not ids:
        return None
    pattern = re.compile("|".join(re.escape(s) for s in sorted(ids, key=len, reverse=True)))
    runs = lambda messages: _Runs(_text(tokenizer, messages), pattern, ids)
    s0, u1, a2, u3, t4, t5, a6 = _SENT[:7]
    system, user, reply = ({"role": "system", "content": s0}, {"role": "user", "content": u1},
                           {"role": "assistant", "content": a2})
    chat = [system, user, reply, {"role": "user", "content": u3}]
    closing = {"user": runs(chat[:2]).after(u1), "assistant": runs(chat[:3]).after(a2)}
    full = runs(chat)
    seen = [(full, s0, None), (full, u1, "system"), (full, a2, "user"), (full, u3, "assistant")]
    # Content beside the call: DeepSeek-V3's template renders a reply with content as that content
    # (the call is not serialised), and one without content is refused (transformers drops None).
    # Arguments as a JSON string (DeepSeek concatenates them), else as a mapping (Qwen3.5 iterates).
    for arguments in ('{"x": 1}', {"x": 1}):
        call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": arguments}}
        tools = [user, dict(reply, tool_calls=[call]), {"role": "tool", "tool_call_id": "call_0", "content": t4},
                 {"role": "tool", "tool_call_id": "call_0", "content": t5}, {"role": "assistant", "content": a6}]
        try:
            tool_closing, with_tools = runs(tools[:3]).after(t4), runs(tools)
        except Exception:  # templates without tool turns (Gemma) refuse both: their tool runs cannot occur
            continue
        closing["tool"] = tool_closing
        seen += [(with_tools, t4, "assistant"), (with_tools, t5, "tool"), (with_tools, a6, "tool")]
        break
    bos = ids.get(getattr(tokenizer, "bos_token", None) or "")
    opens, joined, after, system_bare = [], set(), set(), False
    for rendered, sentinel, previous in seen:
        run = rendered.before(sentinel)
        close = closing.get(previous, [])
        if previous is None and run[:1] == [bos]:
            run = run[1:]
        elif close and run[: len(close)] == close:
            run = run[len(close):]
        if run:
            opens.append(run[0])
            joined.update(zip(run, run[1:]))
        elif previous is None:
            system_bare = True
        elif close:
            after.add(close[-1])
        else:
            return None  # nothing between two messages marks where one ends
    if not opens:
        return None
    markers = Markers(None, None, None, opens=tuple(dict.fromkeys(opens)), joined=tuple(sorted(joined)),
                      after=tuple(sorted(after)), system_bare=system_bare)
    from mtplx.bank.anchors import turn_starts

    plain = tokenizer.encode(_text(tokenizer, [user, reply]), add_special_tokens=False)
    first = turn_starts(plain, markers)
    if not first:
        return None
    for tools_merged in (False, True):
        found = replace(markers, preamble=first[0], tools_merged=tools_merged)
        if _reads(tokenizer, found, chat) and ("tool" not in closing or _reads(tokenizer, found, tools)):
            return found
    return None


def _reads(tokenizer, markers: Markers, messages: list[dict]) -> bool:
    """Whether the spans these markers give put every probe message's content in its own span."""
    from mtplx.bank.spans import message_spans

    prompt = tokenizer.encode(_text(tokenizer, messages), add_special_tokens=False)
    spans = message_spans(prompt, messages, markers)
    if len(spans) != len(messages):
        return False
    for span, m in zip(spans, messages):
        inside = tokenizer.decode(prompt[span.start: span.end])
        others = [o["content"] for o, s in zip(messages, spans) if (s.start, s.end) != (span.start, span.end)]
        if m["content"] not in inside or any(c in inside for c in others):
            return False
    return True
