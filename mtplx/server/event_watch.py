"""GET /v1/mtplx/events: every engine event of every request, as SSE, for a watcher
(`mtplx tui --attach`).

The engine thread queues events; the stream sends them in batches, one wake-up of the server's
loop per batch and at most every WATCH_INTERVAL. A wake-up per event took, on a small machine, the
cores the engine decodes with (as it did inside the TUI: tui/event_feed.py). A watcher that stops
reading loses events past WATCH_BACKLOG, never memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from typing import AsyncIterator

from mtplx.events import event_dict

WATCH_INTERVAL = 0.05  # seconds between two batches
WATCH_BACKLOG = 10_000  # events held for a watcher that does not read


def sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


class Watchers:
    """The open event streams of one app. A server that shuts down ends them first: uvicorn waits
    a few seconds for open connections, then cancels what is left, and a watcher's stream, which
    never ends on its own, was cut that way with a traceback in the server's log."""

    def __init__(self):
        self._open: set = set()

    def close_all(self) -> None:
        """End every stream after what it holds (any thread)."""
        for close in list(self._open):
            close()

    def watch(self, engine) -> AsyncIterator[bytes]:
        """Subscribe to `engine`'s events now (on the event loop); the SSE bytes to send. The
        subscription ends when the iterator is closed (the client left) or `close_all` runs."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        pending: deque = deque()
        armed, closing = [False], [False]

        def push(event):  # on the engine thread
            if len(pending) >= WATCH_BACKLOG:
                return
            pending.append(event)
            if not armed[0]:
                armed[0] = True
                loop.call_soon_threadsafe(ready.set)

        def close():
            closing[0] = True
            with contextlib.suppress(RuntimeError):  # the loop has closed: the stream is gone already
                loop.call_soon_threadsafe(ready.set)

        engine.listeners.append(push)
        self._open.add(close)

        async def stream():
            try:
                yield b": connected\n\n"
                while True:
                    await ready.wait()
                    ready.clear()
                    armed[0] = False  # events from here on wake the stream again
                    batch = []
                    while pending:
                        event = pending.popleft()
                        batch.append(sse(type(event).__name__, event_dict(event)))
                    if batch:
                        yield b"".join(batch)
                    if closing[0]:
                        return
                    await asyncio.sleep(WATCH_INTERVAL)
            finally:
                engine.listeners.remove(push)
                self._open.discard(close)

        return stream()
