"""The head of a prompt whose template has no system turn of its own.

Gemma's template (and others like it) writes the system prompt at the start of the first user
turn, so no turn marker ends it and the head anchor (system + tools, what every new session of an
agent repeats) is never found: a new session then restores at most a grid point inside that
head, and in a long conversation those checkpoints are thinned away, so on a sliding-window or
recurrent model it restores nothing of it. Here the head ends where the first user message's own
text begins: found by rendering the leading system messages before two different probe user
messages (their renderings part there), once per system prompt and tools, and kept as an anchor
only where the request's prompt holds exactly those tokens up to that point.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from mtplx.bank.plan import common_prefix

log = logging.getLogger("mtplx.bank")

PROBES = ("What is in docs?", "Zebra crossing, 42.")  # first tokens unlike each other and any separator
KEEP = 64  # system prompts remembered (each costs two renderings the first time it is seen)


def probed(known: OrderedDict, key: str, probe):
    """`probe()` for `key`, remembered: the KEEP most recently used (a probe renders the template)."""
    if key not in known:
        known[key] = probe()
        if len(known) > KEEP:
            known.popitem(last=False)
    known.move_to_end(key)
    return known[key]


def leading_system(messages: list) -> list[dict]:
    """The system (and developer) messages a conversation opens with."""
    lead = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        lead.append(m)
    return lead


class FoldedHeads:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    def head(self, chat: dict | None, prompt) -> int | None:
        """Where the head of `prompt` (the request's tokens; `chat` its messages and tools) ends:
        the first token of its first user message's text, or None when it has no leading system
        message or its tokens up to there are not the probe's."""
        messages = (chat or {}).get("messages") or []
        lead = leading_system(messages)
        if not lead or len(lead) == len(messages):
            return None
        key = json.dumps([lead, chat.get("tools")], sort_keys=True, default=str)
        end, probe = probed(self.known, key, lambda: self._probe(lead, chat.get("tools")))
        if not end or end >= len(prompt) or common_prefix(prompt[:end], probe[:end]) < end:
            return None
        return end

    def _probe(self, lead: list[dict], tools) -> tuple[int, list[int]]:
        from mtplx.chat import render

        try:
            a, b = (render(self.tokenizer, [*lead, {"role": "user", "content": text}], tools) for text in PROBES)
        except Exception as exc:  # a template that refuses the probe: no head for this prompt
            log.debug("no folded head: the template refused the probe (%s)", exc)
            return 0, []
        return common_prefix(a, b), a
