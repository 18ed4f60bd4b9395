"""The prompt of a legacy /v1/completions request, as token ids, and the options that change
what its answer holds.

OpenAI's `prompt` may be a string, token ids, or a list of either (a batch, as evaluation
harnesses send). Each prompt of a batch is a turn of its own, with `n` choices each; the answer's
choice p * n + j is prompt p's choice j, as OpenAI numbers them. `echo` puts each prompt's text
before its completions; with `logprobs` too, each prompt token after the first is scored (its
log-probability given the ones before it: what evaluation harnesses ask for), as OpenAI's legacy
API did. `suffix` (fill-in-the-middle) and `best_of` above 1 change what must be generated, so
they are refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.server.api_error import bad_request
from mtplx.server.openai_request import flag, stream_flag


@dataclass(frozen=True)
class CompletionPrompt:
    ids: list[int] | None  # given as token ids; None when given as text (encoded on a worker thread)
    text: str | None  # given as text
    echo: bool

    def tokens(self, tokenizer) -> list[int]:
        return self.ids if self.ids is not None else list(tokenizer.encode(self.text))

    def echoed(self, tokenizer) -> str:
        """What `echo` puts before the completion: the prompt as the client wrote it (ids decoded)."""
        if not self.echo:
            return ""
        return self.text if self.text is not None else tokenizer.decode(self.ids)


MOST_TURNS = 64  # prompts x n: each is a turn (its own prefill), queued beyond the scheduler's batch


def parse(body: dict, vocab_size: int, n: int = 1) -> list[CompletionPrompt]:
    """The request's prompts (one, or a batch), each with `n` choices."""
    prompt = body.get("prompt")
    batch = (prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
             else [prompt])
    if len(batch) * n > MOST_TURNS:
        raise bad_request(f"{len(batch)} prompts x n = {n} asks for {len(batch) * n} completions; at most {MOST_TURNS} "
                          "a request", "prompt")
    echo = flag(body, "echo")
    if echo and body.get("logprobs") is not None and stream_flag(body):
        raise bad_request("echo with logprobs (the prompt scored too) is answered whole, not streamed", "stream")
    if body.get("suffix"):
        raise bad_request("suffix (fill-in-the-middle) is not supported by this server", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of must be 1", "best_of")
    return [_one(p, vocab_size, echo, "prompt" if len(batch) == 1 else f"prompt[{i}]") for i, p in enumerate(batch)]


def _one(prompt, vocab_size: int, echo: bool, param: str) -> CompletionPrompt:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{param} must be a non-empty string or a list of token ids", param)
        ids, text = None, prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise bad_request(f"{param} token {bad} is outside this model's vocabulary of {vocab_size}", param)
        ids, text = list(prompt), None
    else:
        raise bad_request(f"{param} must be a non-empty string or a list of token ids", param)
    return CompletionPrompt(ids, text, echo)
