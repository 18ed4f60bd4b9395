"""What a serving process holds for its whole life, kept out of Python's full collections.

A process that serves builds a large heap before its first request: the tokenizer and chat
template, transformers' and MLX's modules, the model's Python objects, FastAPI's routes, Textual's
widgets. Python's full (generation 2) collection walks all of it while holding the GIL, so the
engine thread waits the whole time: in `mtplx tui` with an agent's answers streaming through its
endpoint, 36-102 ms every 10-20 s, and an answer caught by one decoded at half speed.
`gc.freeze()` moves everything alive now into a generation the collector never walks; what is
allocated later is collected as before. Cycles among the frozen objects are kept (they were
reachable anyway). Only the CLI's long-running commands call it, never a library user's process.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect once, then leave everything still alive out of later collections."""
    gc.collect()
    gc.freeze()
