"""Engine events -> OpenAI chat completion objects and stream chunks. Pure mapping: the engine
split the reply (Tokens.pieces, Finished.pieces); nothing here parses text."""

from __future__ import annotations

import time
import uuid

from mtplx.events import Finished, Tokens
from mtplx.reply_stream import Piece


def usage(fin: Finished) -> dict:
    reasoning = fin.stats.tokens_by_segment.get("reasoning", 0)
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning, **prediction_usage(fin)}}


def prediction_usage(fin: Finished) -> dict:
    """With a predicted output: its tokens a verify kept, and those it turned down (OpenAI's names)."""
    drafted, kept = fin.stats.predicted_drafted, fin.stats.predicted_accepted
    return {"accepted_prediction_tokens": kept, "rejected_prediction_tokens": drafted - kept} if drafted else {}


def token_logprobs(entries) -> list[dict]:
    """Chat's `logprobs.content`: the visible reply's tokens (reasoning and tool calls excluded)."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [one(e.text, e.logprob) | {"top_logprobs": [one(t, lp) for _, t, lp in e.top]}
            for e in entries if e.segment == "content"]


def legacy_logprobs(entries, start: int = 0) -> dict:
    """/v1/completions' `logprobs` object; `start`: the text offset of the first entry."""
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries], "text_offset": offsets}


def finish_reason(fin: Finished, tool_calls: int) -> str:
    if tool_calls and fin.finish_reason == "stop":
        return "tool_calls"
    return "length" if fin.finish_reason == "length" else "stop"


class _Choice:
    """One choice's stream of an OpenAI completion: its id and time (shared by every choice of one
    completion: `of` is the first choice's stream) and its index (`n`)."""
    PREFIX = OBJECT = ""

    def __init__(self, model: str, index: int = 0, of: "_Choice | None" = None):
        self.id = of.id if of is not None else self.PREFIX + uuid.uuid4().hex[:24]
        self.created = of.created if of is not None else int(time.time())
        self.model, self.index = model, index

    def usage_chunk(self, fins: list[Finished], n: int | None = None) -> dict:
        return {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_of(fins, n)}


class ChatStream(_Choice):
    """Builds chunks for one streamed chat completion."""
    PREFIX, OBJECT = "chatcmpl-", "chat.completion.chunk"

    def __init__(self, model: str, logprobs: bool = False, index: int = 0, of: "ChatStream | None" = None):
        super().__init__(model, index, of)
        self.calls = 0
        self.fed = 0  # pieces streamed so far; Finished.pieces holds these and what the end released
        # Log-probabilities of content tokens not yet sent: they ride on the next content chunk
        # (the text of a token may be held back a while, e.g. while it could start a stop string).
        self.logprobs = [] if logprobs else None

    def _chunk(self, delta: dict, finish: str | None = None) -> dict:
        logprobs = None
        if self.logprobs and ("content" in delta or finish is not None):
            logprobs, self.logprobs = {"content": token_logprobs(self.logprobs), "refusal": None}, []
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def first(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def tokens(self, event: Tokens) -> list[dict]:
        if self.logprobs is not None:
            self.logprobs += [e for e in event.logprobs if e.segment == "content"]
        return self._pieces(event.pieces)

    def _pieces(self, pieces) -> list[dict]:
        self.fed += len(pieces)
        return [c for p in pieces for c in self._piece(p)]

    def _piece(self, piece: Piece) -> list[dict]:
        if piece.kind == "reasoning":
            return [self._chunk({"reasoning_content": piece.text})]
        if piece.kind == "content":
            return [self._chunk({"content": piece.text})]
        index, self.calls = self.calls, self.calls + 1
        head = {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
        return [self._chunk({"tool_calls": [head]}),
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece.arguments}}]})]

    def finish(self, fin: Finished, include_usage: bool) -> list[dict]:
        out = self._pieces(fin.pieces[self.fed:])
        out.append(self._chunk({}, finish_reason(fin, self.calls)))
        if include_usage:
            out.append(self.usage_chunk([fin]))
        return out


def usage_of(fins: list[Finished], n: int | None = None) -> dict:
    """One usage for a completion's choices: each prompt counted once (`n` choices a prompt, in
    order; None: every choice had the same prompt), the reply tokens of all of them."""
    out = usage(fins[0])
    if len(fins) > 1:
        prompts = fins[:: n or len(fins)]
        out["prompt_tokens"] = sum(f.prompt_tokens for f in prompts)
        out["prompt_tokens_details"]["cached_tokens"] = sum(f.cached_tokens for f in prompts)
        out["completion_tokens"] = sum(f.completion_tokens for f in fins)
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        out["completion_tokens_details"]["reasoning_tokens"] = sum(
            f.stats.tokens_by_segment.get("reasoning", 0) for f in fins)
    return out


def completion(model: str, fin: Finished, logprobs: bool = False) -> dict:
    """A whole (non-streamed) chat completion."""
    return completions(model, [fin], logprobs)


def completions(model: str, fins: list[Finished], logprobs: bool = False) -> dict:
    """A whole chat completion of one choice per Finished, in order (chat's `n`)."""
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [_choice(i, fin, logprobs) for i, fin in enumerate(fins)], "usage": usage_of(fins)}


def _choice(index: int, fin: Finished, logprobs: bool) -> dict:
    pieces = fin.pieces
    content = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": p.name, "arguments": p.arguments}} for p in pieces if p.kind == "tool_call"]
    message = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message,
            "logprobs": {"content": token_logprobs(fin.logprobs), "refusal": None} if logprobs else None,
            "finish_reason": finish_reason(fin, len(calls))}


def text_completion(model: str, fin: Finished, logprobs: bool = False, echo: str = "") -> dict:
    """`echo`: the prompt's text, when the request asked for it before the completion."""
    return text_completions(model, [fin], logprobs, [echo])


def text_completions(model: str, fins: list[Finished], logprobs: bool, echoes: list[str], n: int | None = None) -> dict:
    """A whole /v1/completions answer of one choice per Finished, in order (prompts x `n`);
    `echoes[i]`: what goes before choice i's text."""
    return {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": i, "text": echo + fin.text,
                                         "logprobs": _text_logprobs(fin, echo) if logprobs else None,
                                         "finish_reason": "length" if fin.finish_reason == "length" else "stop"}
                                        for i, (fin, echo) in enumerate(zip(fins, echoes))],
            "usage": usage_of(fins, n)}


def _text_logprobs(fin: Finished, echo: str) -> dict:
    """A text choice's legacy logprobs: with an echoed, scored prompt, its tokens come first (the
    first has no log-probability: nothing comes before it, as OpenAI reports it)."""
    if not echo or not fin.prompt_logprobs:
        return legacy_logprobs(fin.logprobs)
    second = max(0, len(echo) - sum(len(e.text) for e in fin.prompt_logprobs))  # where token 2's text starts
    whole = legacy_logprobs(fin.prompt_logprobs + tuple(fin.logprobs), second)
    first = echo[:second]
    return {"tokens": [first] + whole["tokens"], "token_logprobs": [None] + whole["token_logprobs"],
            "top_logprobs": [None] + whole["top_logprobs"], "text_offset": [0] + whole["text_offset"]}


class TextCompletionStream(_Choice):
    """Chunks of one streamed /v1/completions answer: raw text, no reasoning or tool-call split."""
    PREFIX, OBJECT = "cmpl-", "text_completion"

    def __init__(self, model: str, logprobs: bool = False, index: int = 0, of: "TextCompletionStream | None" = None):
        super().__init__(model, index, of)
        self.logprobs, self.offset = logprobs, 0

    def _chunk(self, text: str, finish: str | None = None, logprobs=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def first(self, echo: str) -> dict | None:
        """The echoed prompt, as the stream's first chunk (None when not asked for)."""
        return self._chunk(echo) if echo else None

    def tokens(self, event: Tokens) -> list[dict]:
        if not event.text and not event.logprobs:
            return []
        logprobs = legacy_logprobs(event.logprobs, self.offset) if self.logprobs else None
        self.offset += sum(len(e.text) for e in event.logprobs)
        return [self._chunk(event.text, logprobs=logprobs)]

    def finish(self, fin: Finished, include_usage: bool) -> list[dict]:
        out = [self._chunk("", "length" if fin.finish_reason == "length" else "stop")]
        if include_usage:
            out.append(self.usage_chunk([fin]))
        return out
