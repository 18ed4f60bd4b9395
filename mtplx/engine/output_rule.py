"""A reply held to a JSON schema: structured output enforced on the logits, not checked after.

llguidance compiles the schema into a grammar over the model's own tokens and answers, for the
tokens written so far, which next tokens keep the text a prefix of a document the schema accepts
(and, once the document is whole, only the end-of-turn tokens). `apply` masks one position's
logits to that set. The generation loop calls it where it calls a tool rule — autoregressive
picks, MTP drafts and every row of a verify, each with the tokens before it — so MTP under a
schema keeps exactly what autoregressive decoding under it keeps.

Reasoning stays free: with reasoning tags the schema starts after the closing tag (a model may
open its reasoning where the reply starts). Where the request lets the model call a tool, the
tool-call opening token is allowed until the document's first character, and once a call is
open the schema steps aside (the call is the reply).

One matcher per request, on the engine thread. Calls come with growing histories, and with a
draft chain's speculative tails that the next call drops, so the matcher follows the history by
rolling back to the common prefix and consuming the rest.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from mtplx.call_grammar import JSON_OPTIONS
from mtplx.engine.tool_rule import content_start

# Leading blank text before the document (Qwen writes "\n\n" after its reasoning), bounded so a
# model cannot fill its budget with newlines.
_LEAD = r"/[ \t\r\n]{0,8}/"

# A JSON number longer than this must end: float64 holds 17 significant digits, and a model
# looping on digits (the tiny ones do, under a bare "integer") would otherwise write until its
# budget ends. The grammar alone cannot say it: llguidance bounds integers only within i64.
MAX_NUMBER = 32
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")

_tokenizers: dict[int, object] = {}
_numeric_starts: dict[int, np.ndarray] = {}
_lock = threading.Lock()


def ll_tokenizer(tokenizer, eos_ids: Sequence[int]):
    """llguidance's view of the model's tokenizer (an mlx-lm wrapper or a Hugging Face fast
    tokenizer), built once per tokenizer: ~1 s for a 150k-token vocabulary."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    # mlx-lm's wrapper holds the Hugging Face tokenizer (and passes its attributes through).
    hf = tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else getattr(tokenizer, "_tokenizer", tokenizer)
    key = id(hf)
    with _lock:
        if key not in _tokenizers:
            _tokenizers[key] = (hf, llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos_ids) or None))
        return _tokenizers[key][1]


@dataclass(frozen=True)
class Grammar:
    """A schema compiled for one tokenizer; `OutputRule`s are started from it."""
    text: str  # llguidance's grammar
    tokenizer: object  # llguidance.LLTokenizer
    eos: frozenset[int]

    @classmethod
    def from_schema(cls, schema: dict, tokenizer, eos_ids) -> "Grammar":
        """Raises ValueError naming what is wrong with the schema."""
        # The document is written with fixed separators and no other blank text (call_grammar's
        # JSON_OPTIONS). Keywords llguidance does not enforce are accepted (and not enforced)
        # rather than refused.
        options = JSON_OPTIONS | (schema.get("x-guidance") or {})
        return cls.from_lark(f"start: {_LEAD} document\ndocument: %json {json.dumps(schema | {'x-guidance': options})}",
                             tokenizer, eos_ids)

    @classmethod
    def from_lark(cls, lark: str, tokenizer, eos_ids) -> "Grammar":
        """Raises ValueError naming what is wrong with the grammar."""
        import llguidance

        try:
            text = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
        problem = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if problem:
            raise ValueError(problem)
        return cls(text, tokenizer, frozenset(eos_ids))


class OutputRule:
    history_free = False  # each position's set depends on the tokens before it

    def __init__(self, grammar: Grammar, *, think: tuple[int, int] | None = None, starts_in_reasoning: bool = False,
                 call_open: int | None = None):
        import llguidance

        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text)
        self.think, self.starts_in_reasoning, self.call_open = think, starts_in_reasoning, call_open
        self._fed: list[int] = []  # reply tokens the matcher has consumed (after any reasoning)
        # After each fed token: (inside a string, after a backslash there, length of the number being written).
        self._lex: list[tuple[bool, bool, int]] = []
        self._blank: dict[int, bool] = {}

    def apply(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """The logits of one position (last axis = vocabulary) after the rule."""
        start = content_start(history, self.think, self.starts_in_reasoning)
        if start is None:  # reasoning
            return logits
        content = list(history[start:])
        if self.call_open is not None and self.call_open in content:
            return logits
        if any(t in self.grammar.eos for t in content):
            return logits  # nothing after the end of the turn is kept (and the matcher is not fed it:
            # it cannot take the end token again after rolling it back)
        if not self._follow(content):
            return logits  # the matcher lost the text (see _follow); never block the reply
        extra = []
        if all(self._is_blank(t) for t in content):
            if self.call_open is not None:
                extra.append(self.call_open)
            if not history and self.think is not None and not self.starts_in_reasoning:
                extra.append(self.think[0])  # the model may open its reasoning first
        return self._masked(logits, extra)

    def _masked(self, logits: mx.array, extra: list[int]) -> mx.array:
        """The logits with only the matcher's next tokens (and `extra`) left."""
        allowed = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        width = logits.shape[-1]
        allowed = allowed[:width] if allowed.size >= width else np.pad(allowed, (0, width - allowed.size))
        allowed = allowed.astype(bool)
        allowed[[t for t in extra if t < width]] = True
        in_string, _, number = self._lex[-1] if self._lex else (False, False, 0)
        if not in_string and number >= MAX_NUMBER:
            ended = allowed & ~self._numeric_start(width)
            if ended.any():  # past the grammar's own minimum (a digit after "." or "e"), always true here
                allowed = ended
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def _numeric_start(self, width: int) -> np.ndarray:
        """Tokens whose text starts with a character that continues a number, once per tokenizer."""
        key = id(self.grammar.tokenizer)
        with _lock:
            if key not in _numeric_starts:
                decode = self.grammar.tokenizer.decode_bytes
                _numeric_starts[key] = np.array([(b := decode([t]))[:1] != b"" and b[0] in _NUMBER_BYTES
                                                 for t in range(self.grammar.tokenizer.vocab_size)], dtype=bool)
            starts = _numeric_starts[key]
        return starts[:width] if starts.size >= width else np.pad(starts, (0, width - starts.size))

    def _lexed(self, token: int) -> tuple[bool, bool, int]:
        """The string / number state after `token`, from the state before it."""
        in_string, escaped, number = self._lex[-1] if self._lex else (False, False, 0)
        for byte in self.grammar.tokenizer.decode_bytes([token]):
            if in_string:
                if escaped:
                    escaped = False
                elif byte == 0x5C:  # backslash
                    escaped = True
                elif byte == 0x22:  # closing quote
                    in_string = False
            elif byte == 0x22:
                in_string, number = True, 0
            else:
                number = number + 1 if byte in _NUMBER_BYTES else 0
        return in_string, escaped, number

    def _follow(self, content: list[int]) -> bool:
        """Bring the matcher to `content`: roll back to the common prefix, consume the rest."""
        n = 0
        for a, b in zip(self._fed, content):
            if a != b:
                break
            n += 1
        if n < len(self._fed):
            if self.matcher.rollback(len(self._fed) - n):
                del self._fed[n:], self._lex[n:]
            else:  # past what it can roll back: start over
                self.matcher.reset()
                self._fed, self._lex = [], []
        for token in content[len(self._fed):]:
            if not self.matcher.consume_token(token):
                # A token the mask did not allow (none is drawn from these logits; a history from
                # elsewhere): the matcher errs for good, so it restarts on the text it took, and
                # this position goes free.
                self.matcher.reset()
                self.matcher.consume_tokens(self._fed)
                return False
            self._lex.append(self._lexed(token))
            self._fed.append(token)
        return True

    def _is_blank(self, token: int) -> bool:
        if token not in self._blank:
            self._blank[token] = not self.grammar.tokenizer.decode_str([token]).strip()
        return self._blank[token]
