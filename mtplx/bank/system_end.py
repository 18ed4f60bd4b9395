"""Where a prompt's system text ends and its tool list begins, inside the head.

The head anchor (system prompt + tools) is what a new session of an agent repeats. When the tools
change and the system prompt does not (an MCP server connects, an agent switches mode, a
subagent gets fewer tools), the new head shares its first part with the old one: every token up to
where the tool list begins. An attention-only model restores any such prefix; a hybrid (GDN)
model only where a recurrent state was captured, and the head's own anchor lies past the change.
So the bank keeps an anchor there too. Found without knowing the template: the leading system
messages before a probe user message, rendered with the request's tools and without any, part
where the tools begin (once per system prompt and tools), and kept only where the request's
prompt holds exactly those tokens up to that point, before its head ends.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from mtplx.bank.folded_head import PROBES, leading_system, probed
from mtplx.bank.plan import common_prefix

log = logging.getLogger("mtplx.bank")


class SystemEnds:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    def position(self, chat: dict | None, prompt, head: int) -> int | None:
        """Where the system text of `prompt` (the request's tokens, `chat` its messages and tools)
        ends, when it is followed by tools before the head ends at `head`; else None."""
        tools = (chat or {}).get("tools")
        lead = leading_system((chat or {}).get("messages") or [])
        if not tools or not lead:
            return None
        key = json.dumps([lead, tools], sort_keys=True, default=str)
        end, bare = probed(self.known, key, lambda: self._probe(lead, tools))
        if not 0 < end < head or common_prefix(prompt[:end], bare[:end]) < end:
            return None
        return end

    def _probe(self, lead: list[dict], tools) -> tuple[int, list[int]]:
        from mtplx.chat import render

        probe = [*lead, {"role": "user", "content": PROBES[0]}]
        try:
            with_tools, bare = render(self.tokenizer, probe, tools), render(self.tokenizer, probe, None)
        except Exception as exc:  # a template that refuses the probe: no such anchor for this prompt
            log.debug("no system-end anchor: the template refused the probe (%s)", exc)
            return 0, []
        return common_prefix(with_tools, bare), bare
