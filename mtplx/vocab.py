"""Single vocabulary entries by their text, without building the whole vocabulary."""

from __future__ import annotations


def token_id(tokenizer, token: str) -> int | None:
    """The id of one vocabulary entry, or None. Asked token by token: a real tokenizer's
    `get_vocab()` builds a dict of the whole vocabulary (~200 ms for Qwen3's 151k entries)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found < 0:
        return None
    return found if tokenizer.convert_ids_to_tokens(found) == token else None  # not an unknown-token stand-in
