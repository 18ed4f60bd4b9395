"""Incremental detokenisation with stop strings.

Text is released only when it is complete (no dangling UTF-8 byte) and cannot be the start of a
stop string; a stop string ends the text before it, as OpenAI's `stop` does. Stops match only the
text a client is shown as content: not reasoning, not tool-call markup, not the whitespace that
opens a segment (which the server strips), so `stop: ["\n"]` cannot end a reply before its first
visible character.
"""

from __future__ import annotations

import weakref
from typing import Callable

from mtplx.reply_stream import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN

HIDDEN = "\0"  # stands in for a character the client does not see as content; no stop contains it


def visible_mask(text: str, in_reasoning: bool, call_tags: tuple[str, str] = (CALL_OPEN, CALL_CLOSE)) -> str:
    """`text` with every character outside visible content replaced by HIDDEN (same length).
    `call_tags`: the model's tool-call delimiters (tool_formats.py); a format without a closing
    tag ("") hides everything after its opening one."""
    modes = {THINK_OPEN: "reasoning", THINK_CLOSE: "content", call_tags[0]: "tool_call"}
    if call_tags[1]:
        modes[call_tags[1]] = "content"
    out, i, mode, fresh = [], 0, "reasoning" if in_reasoning else "content", True
    while i < len(text):
        found = [(at, tag) for tag in modes if (at := text.find(tag, i)) != -1]
        at, tag = min(found) if found else (len(text), None)
        span = text[i:at]
        if mode == "content":
            body = span.lstrip() if fresh else span
            out.append(HIDDEN * (len(span) - len(body)) + body)
            fresh = fresh and not body
        else:
            out.append(HIDDEN * len(span))
        if tag is None:
            break
        out.append(HIDDEN * len(tag))
        i, fresh = at + len(tag), True
        mode = modes[tag]
    return "".join(out)


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = (), in_reasoning: bool = False,
                 call_tags: tuple[str, str] = (CALL_OPEN, CALL_CLOSE), markup: tuple[str, ...] = (),
                 mask: Callable[[str], str] | None = None):
        """`call_tags`: the model's tool-call delimiters; `markup`: further special tokens its
        replies are read by (gpt-oss's harmony headers), kept in the text; `mask`: what of the text
        is visible content, when the tags alone do not say (harmony.visible_mask)."""
        self.tokenizer = tokenizer
        self._raw = _raw_decode(tokenizer)  # resolved once: _decode runs twice per generated token
        self.call_tags = call_tags
        self.kept = (THINK_OPEN, THINK_CLOSE) + tuple(call_tags) + tuple(markup)
        self.mask = mask or (lambda text: visible_mask(text, self.in_reasoning, self.call_tags))
        self.stops = stops
        self.in_reasoning = in_reasoning
        self.ids: list[int] = []
        self._prefix = 0  # decode window start (keeps merges across token boundaries right)
        self._read = 0  # tokens whose text is already in self.text
        self.text = ""
        self.released = 0  # characters of self.text handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (the earliest one found)

    def _decode(self, ids: list[int]) -> str:
        hidden = _hidden_ids(self.tokenizer, self.kept)
        decode = self._raw or self.tokenizer.decode
        if hidden is None:
            return decode(ids, skip_special_tokens=True)
        return decode([i for i in ids if i not in hidden], skip_special_tokens=False)

    def add(self, token: int) -> str:
        """Append one token; returns the newly released text ('' if held back)."""
        self.ids.append(token)
        window = self._decode(self.ids[self._prefix :])
        if window.endswith("\ufffd"):
            return ""
        done = self._decode(self.ids[self._prefix : self._read])
        self.text += window[len(done) :]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        visible = self.mask(self.text) if self.stops else self.text
        for stop in self.stops:
            at = visible.find(stop, max(0, self.released - len(stop)))
            if at != -1:  # a later stop in the loop is searched only before this one: the earliest wins
                self.text, visible, self.stopped, self.matched = self.text[:at], visible[:at], True, stop
        end = len(self.text)
        if not self.stopped:
            for stop in self.stops:  # hold back a tail that may grow into a stop string
                for n in range(min(len(stop) - 1, len(visible)), 0, -1):
                    if visible.endswith(stop[:n]):
                        end = min(end, len(self.text) - n)
                        break
        out, self.released = self.text[self.released : max(end, self.released)], max(end, self.released)
        return out

    def flush(self) -> str:
        """At the end: release whatever was held back (it did not become a stop string)."""
        out, self.released = self.text[self.released :], len(self.text)
        return out


_HIDDEN_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_RAW: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
RAW_DECODE = True  # False: every decode through `tokenizer.decode` (tests compare the two)


def _raw_decode(tokenizer):
    """The Rust tokenizer's own decode where it gives exactly what `tokenizer.decode` gives (a
    transformers fast tokenizer, directly or inside mlx-lm's wrapper, with its decode methods its
    library's own and no clean-up of tokenization spaces), else None. Every generated token is
    decoded twice (its window with and without it), and transformers' Python wrapper around the
    Rust call (argument conversion, checks) cost ~15x the call itself: with several sequences
    decoding together that was a large share of the engine thread's time."""
    if not RAW_DECODE:
        return None
    try:
        if tokenizer in _RAW:
            return _RAW[tokenizer]
    except TypeError:
        return None
    _RAW[tokenizer] = found = _rust_decode(tokenizer)
    return found


def _rust_decode(tokenizer):
    inner = getattr(tokenizer, "_tokenizer", None)  # mlx-lm's TokenizerWrapper holds the transformers one
    hf = inner if inner is not None and not _is_rust(inner) else tokenizer
    rust = getattr(hf, "_tokenizer", None)
    if not _is_rust(rust) or getattr(hf, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(hf)
    if not isinstance(hf, PreTrainedTokenizerFast) or any(
            getattr(cls, name, None) is not getattr(PreTrainedTokenizerFast, name, None) for name in ("decode", "_decode")):
        return None  # a tokenizer class with a decode of its own: its answer, not the Rust one's
    return rust.decode


def _is_rust(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "tokenizers" and hasattr(obj, "decode")


def _hidden_ids(tokenizer, kept: tuple[str, ...]) -> frozenset[int] | None:
    """The special tokens a reply's text leaves out: all of them (as `skip_special_tokens` does)
    except the reasoning tags and the model's tool-call delimiters, which some tokenizers mark
    special (Mistral's `[TOOL_CALLS]`): dropped, the call's markup vanished and the call reached the
    client as text. None when the tokenizer does not list its added tokens."""
    try:
        known = _HIDDEN_IDS.setdefault(tokenizer, {})
    except TypeError:
        known = {}
    if kept not in known:
        added = getattr(tokenizer, "added_tokens_decoder", None)
        known[kept] = None if not isinstance(added, dict) else frozenset(
            i for i, t in added.items() if getattr(t, "special", False) and str(getattr(t, "content", t)) not in kept)
    return known[kept]
