"""Log-probabilities of the tokens a reply drew, as OpenAI's `logprobs` reports them.

Each drawn token gets its log-probability and the `n` most likely alternatives at its position,
under the distribution it was drawn from *before* temperature and top-k/p: the model's logits
after the request's rules and penalties (a token a rule masked has no probability and is never
listed). The texts are decoded here, on the engine thread, so the server only maps fields.
"""

from __future__ import annotations

import math

from mtplx.events import TokenLogprob


def of_rows(logits, tokens: list[int], n: int, tokenizer) -> list[TokenLogprob]:
    """One entry per row of `logits` (rows = positions, last axis = vocabulary): a verify's kept rows."""
    return [of(logits[i], token, n, tokenizer) for i, token in enumerate(tokens)]


def of(logits, token: int, n: int, tokenizer) -> TokenLogprob:
    """`token`'s entry from one position's logits (last axis = vocabulary)."""
    return of_positions(logits.reshape(1, -1), [token], n, tokenizer)[0]


def of_positions(logits, tokens: list[int], n: int, tokenizer) -> list[TokenLogprob]:
    """Entries for many positions at once (rows of `logits`, each scoring the token after it): a
    prompt's, where one entry at a time would cost a host round trip per token."""
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if n:  # the n best per row, without sorting a whole vocabulary per position
        best = mx.argpartition(-logp, n - 1, axis=-1)[:, :n]
        best_lp = mx.take_along_axis(logp, best, axis=-1)
        order = mx.argsort(-best_lp, axis=-1)
        best_ids = mx.take_along_axis(best, order, axis=-1).tolist()
        best_lp = mx.take_along_axis(best_lp, order, axis=-1).tolist()
    else:
        best_ids = best_lp = [[] for _ in tokens]
    # A position where every token was masked (no rule leaves none; a defence) has no finite
    # log-probability: reported as OpenAI reports a negligible one, never as a value JSON lacks.
    return [TokenLogprob(token, _text(tokenizer, token), lp if math.isfinite(lp) else -9999.0,
                         tuple((i, _text(tokenizer, i), v) for i, v in zip(ids, lps) if v > float("-inf")))
            for token, lp, ids, lps in zip(tokens, chosen.tolist(), best_ids, best_lp)]


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])
