"""The turn structure of a tokenizer's chat template, found once by probing the template.

Templates differ in the special token that opens a turn (`<|im_start|>`, `<|start_header_id|>`,
`<start_of_turn>`) and the one that closes it (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), in
whether a newline follows the close, and in how messages map to turns: Gemma folds the system
message into the first user turn, Qwen wraps a run of tool results in one user turn, Llama 3.1
adds a system turn of its own. Rendering a few probe conversations with sentinel contents and
reading where the sentinels land tells all of that without knowing the template. Only the
structure is kept (ids and flags); the planner never sees text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Sentinel contents: plain words no template rewrites (trim, escaping) and no probe repeats.
_SENT = ["qzxsentinel%d" % i for i in range(6)]


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

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Markers":
        """Probe the tokenizer's chat template; ChatML's tokens where it has no usable template."""
        try:
            found = probe(tokenizer)
        except Exception:  # a template that refuses the probe (or none at all): fall back to ChatML
            found = None
        return found or chatml(tokenizer)


def chatml(tokenizer) -> Markers:
    vocab = tokenizer.get_vocab()
    nl = tokenizer.encode("\n", add_special_tokens=False)
    return Markers(vocab.get("<|im_start|>"), vocab.get("<|im_end|>"), nl[0] if len(nl) == 1 else None,
                   tuple(tokenizer.encode("system", add_special_tokens=False)))


def _text(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)


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
