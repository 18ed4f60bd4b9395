"""The tokenizer endpoints vLLM serves, which evaluation harnesses and token counters call.

lm-evaluation-harness's `local-completions` looks for them before anything else: when
`GET /tokenizer_info` and `POST /tokenize` answer, it counts and splits contexts with the
server's own tokenizer; otherwise it wants a Hugging Face tokenizer id, which an offline machine
or a local conversion does not have. Bodies and answers keep vLLM's field names:

    GET  /tokenizer_info  special tokens, the chat template, the context window
    POST /tokenize        {"prompt": text, "add_special_tokens"} or {"messages", "tools",
                          "add_generation_prompt"}: {"tokens", "count", "max_model_len"}
                          (+ "token_strs" with "return_token_strs": true)
    POST /detokenize      {"tokens": [...]}: {"prompt": text}

Messages are rendered as the chat route renders them (the same tokens a turn would prefill), so
a count is the prompt a request would cost. Pure mapping; the app runs these off the event loop.
"""

from __future__ import annotations

from mtplx.server.api_error import bad_request


def info(tokenizer, window: int) -> dict:
    def token(name: str):
        value = getattr(tokenizer, name, None)
        return value if isinstance(value, str) else None

    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": token("eos_token"), "bos_token": token("bos_token"),
            "pad_token": token("pad_token"), "unk_token": token("unk_token"),
            "chat_template": getattr(tokenizer, "chat_template", None) if isinstance(
                getattr(tokenizer, "chat_template", None), str) else None,
            "model_max_length": window, "vocab_size": len(tokenizer)}


def prompt_tokens(body: dict, tokenizer) -> list[int]:
    """A text prompt's tokens (vLLM adds special tokens unless told not to)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (or send messages)", "prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    return list(tokenizer.encode(prompt, add_special_tokens=special))


def answer(tokens: list[int], tokenizer, window: int, body: dict) -> dict:
    out = {"count": len(tokens), "max_model_len": window, "tokens": tokens}
    if body.get("return_token_strs") is True:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return out


def detokenized(body: dict, tokenizer) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    bad = next((t for t in tokens if not 0 <= t < len(tokenizer)), None)
    if bad is not None:
        raise bad_request(f"token {bad} is outside this model's vocabulary of {len(tokenizer)}", "tokens")
    return {"prompt": tokenizer.decode(tokens)}
