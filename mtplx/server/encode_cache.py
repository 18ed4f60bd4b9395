"""Memoised chat rendering + tokenisation (the per-request tax of long agent transcripts).

Keyed by content: a hash of the raw request body (it holds the messages, tools, tool_choice and
thinking flags; hashing its bytes costs a fraction of re-serialising them), the route, the
tokenizer's identity and the template's own hash (plus today's date when the template can print
one). Hits hand out copies. `MTPLX_ENCODE_CACHE=off` disables it. Requests encode on worker
threads, so the map is guarded by a lock.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
from collections import OrderedDict


class EncodeCache:
    def __init__(self, identity: str, template: str, capacity: int = 128):
        self.capacity = capacity
        self.enabled = os.environ.get("MTPLX_ENCODE_CACHE", "on").lower() not in ("off", "0", "false")
        self.salt = hashlib.sha256((identity + "\0" + template).encode()).hexdigest()
        self.dated = "strftime_now" in template or "date_string" in template
        self.entries: OrderedDict[str, tuple[list[int], dict]] = OrderedDict()
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    def key(self, route: str, body: bytes) -> str:
        digest = hashlib.sha256(self.salt.encode() + route.encode())
        digest.update(body)
        if self.dated:
            digest.update(datetime.date.today().isoformat().encode())
        return digest.hexdigest()

    def get(self, key: str) -> tuple[list[int], dict] | None:
        with self.lock:
            if not self.enabled or key not in self.entries:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            tokens, extra = self.entries[key]
        return list(tokens), dict(extra)

    def put(self, key: str, tokens: list[int], extra: dict) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.entries[key] = (list(tokens), dict(extra))
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
