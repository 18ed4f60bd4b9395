"""Attach mode: follow a running `mtplx serve` through its event stream, and its bank through
`GET /v1/mtplx/bank`, with the same views as the embedded engine.

The connection state is always on screen (connecting, connected, refused, unauthorized,
reconnecting in Ns); a lost stream (a server restart) is retried with a doubling back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Callable

import httpx

from mtplx.events import BankDecision, Restored, event_from_dict

MAX_BACKOFF_S = 30.0
HEALTH_S = 2.0  # /health is re-read this often (a stalled collective, each rank's bank)


def normalise(url: str) -> str:
    """The server's root: `host:port`, `http://host:port/` and `http://host:port/v1` (the form
    clients are given) all name the same server."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3] if url.endswith("/v1") else url


class Attachment:
    """Runs as an async worker on the app's loop (so quitting cancels it, even mid-read); talks
    to the UI only through the callbacks it was given."""

    def __init__(self, url: str, api_key: str | None, *, on_event: Callable, on_bank: Callable[[list[dict]], None],
                 on_state: Callable[[str], None], on_health: Callable[[dict], None] = lambda report: None,
                 backoff_s: float = 1.0):
        self.base, self.on_event, self.on_bank, self.on_state = normalise(url), on_event, on_bank, on_state
        self.on_health = on_health
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backoff_s = backoff_s

    async def run(self) -> None:
        """Follow the event stream until cancelled, reconnecting after every loss."""
        self._bank_due, self._health_due = asyncio.Event(), asyncio.Event()
        async with httpx.AsyncClient(headers=self.headers, timeout=httpx.Timeout(5.0, read=None)) as client:
            fetcher = asyncio.create_task(self._bank_loop(client))
            health = asyncio.create_task(self._health_loop(client))
            try:
                delay = self.backoff_s
                while True:
                    why = await self._follow(client)
                    if why == "connected":  # it ran, then dropped: retry soon
                        delay, why = self.backoff_s, "stream lost"
                    for left in range(max(1, round(delay)), 0, -1):
                        self.on_state(f"{why}; reconnecting in {left}s")
                        await asyncio.sleep(min(1.0, delay))
                    delay = min(delay * 2, MAX_BACKOFF_S)
            finally:
                fetcher.cancel()
                health.cancel()

    async def _follow(self, client: httpx.AsyncClient) -> str:
        self.on_state("connecting")
        try:
            async with client.stream("GET", self.base + "/v1/mtplx/events") as r:
                if r.status_code in (401, 403):
                    return "unauthorized (pass --api-key or set MTPLX_API_KEY)"
                if r.status_code != 200:
                    return f"HTTP {r.status_code} from {self.base}/v1/mtplx/events (is it an mtplx server?)"
                self.on_state("connected")
                self._bank_due.set()  # what the bank holds now, before any event says so
                self._health_due.set()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        event = event_from_dict(json.loads(line[6:]))
                        if event is None:
                            continue
                        self.on_event(event)
                        if isinstance(event, (BankDecision, Restored)):
                            self._bank_due.set()
            return "connected"
        except httpx.ConnectError:
            return f"refused by {self.base}"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return f"lost: {type(exc).__name__}"

    async def _bank_loop(self, client: httpx.AsyncClient) -> None:
        """One fetch per burst of bank events (at most five a second)."""
        while True:
            await self._bank_due.wait()
            self._bank_due.clear()
            try:
                r = await client.get(self.base + "/v1/mtplx/bank", timeout=10.0)
                if r.status_code == 200:
                    self.on_bank(r.json()["entries"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # the stream's own state says what is wrong; the next bank event retries
            await asyncio.sleep(0.2)

    async def _health_loop(self, client: httpx.AsyncClient) -> None:
        """/health on connecting, then every HEALTH_S (a 503 still carries the report)."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._health_due.wait(), HEALTH_S)
            self._health_due.clear()
            try:
                r = await client.get(self.base + "/health", timeout=10.0)
                if r.status_code in (200, 503):
                    self.on_health(r.json())
            except (httpx.HTTPError, ValueError):
                pass  # the stream's own state says what is wrong
