"""A tool call held to its grammar (mtplx/call_grammar.py) while it is open, on the logits.

Outside a call the logits pass unchanged: the rule neither makes nor forbids a call (that is the
tool rule's part). From the call's opening token to its closing token, only tokens that keep the
body a prefix of a call to one of the request's tools are allowed, and once the body is whole only
the closing token. Each call of a reply is matched afresh. Like every rule it is applied to
autoregressive picks, MTP drafts and every verify row with the tokens before each, so MTP under it
keeps exactly what autoregressive decoding under it keeps.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mtplx.engine.output_rule import Grammar, OutputRule


class CallRule(OutputRule):
    def __init__(self, grammar: Grammar, call_open: int, call_close: int):
        super().__init__(grammar)
        self.open_id, self.close_id = call_open, call_close

    def apply(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        history = list(history)
        try:
            opened = len(history) - 1 - history[::-1].index(self.open_id)
        except ValueError:
            return logits  # no call open
        body = history[opened + 1:]
        if self.close_id in body:
            return logits  # that call is closed; the next one starts its own match
        if not self._follow(body):
            return logits  # the matcher lost the text (a history from elsewhere); never block the reply
        return self._masked(logits, [])
