"""Attach mode: follow a running `mtplx serve` through its event stream, and its bank through
`GET /v1/mtplx/bank`, with the same views as the embedded engine.

The connection state is always on screen (connecting, connected, refused, unauthorized,
reconnecting in Ns); a lost stream (a server restart) is retried with a doubling back-off.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

import httpx

from mtplx.events import BankDecision, Restored, event_from_dict

MAX_BACKOFF_S = 30.0


def normalise(url: str) -> str:
    """The server's root: `host:port`, `http://host:port/` and `http://host:port/v1` (the form
    clients are given) all name the same server."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[:-3] if url.endswith("/v1") else url


class Attachment:
    """Runs in a worker thread; talks to the UI only through the callbacks it was given."""

    def __init__(self, url: str, api_key: str | None, *, on_event: Callable, on_bank: Callable[[list[dict]], None],
                 on_state: Callable[[str], None], backoff_s: float = 1.0):
        self.base, self.on_event, self.on_bank, self.on_state = normalise(url), on_event, on_bank, on_state
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backoff_s = backoff_s
        self.stopped = threading.Event()
        self._bank_due = threading.Event()

    def stop(self) -> None:
        self.stopped.set()
        self._bank_due.set()

    def run(self) -> None:
        """Follow the event stream until stopped, reconnecting after every loss."""
        threading.Thread(target=self._bank_loop, name="mtplx-attach-bank", daemon=True).start()
        delay = self.backoff_s
        while not self.stopped.is_set():
            why = self._follow()
            if why == "connected":  # it ran, then dropped: retry soon
                delay, why = self.backoff_s, "stream lost"
            if self.stopped.is_set():
                return
            for left in range(max(1, round(delay)), 0, -1):
                self.on_state(f"{why}; reconnecting in {left}s")
                if self.stopped.wait(min(1.0, delay)):
                    return
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _follow(self) -> str:
        self.on_state("connecting")
        try:
            with httpx.stream("GET", self.base + "/v1/mtplx/events", headers=self.headers,
                              timeout=httpx.Timeout(5.0, read=None)) as r:
                if r.status_code in (401, 403):
                    return "unauthorized (pass --api-key or set MTPLX_API_KEY)"
                if r.status_code != 200:
                    return f"HTTP {r.status_code} from {self.base}/v1/mtplx/events (is it an mtplx server?)"
                self.on_state("connected")
                self._bank_due.set()  # what the bank holds now, before any event says so
                for line in r.iter_lines():
                    if self.stopped.is_set():
                        return "stopped"
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

    def _bank_loop(self) -> None:
        """One fetch per burst of bank events (at most five a second), off the stream's thread."""
        while not self.stopped.is_set():
            self._bank_due.wait()
            self._bank_due.clear()
            if self.stopped.is_set():
                return
            try:
                r = httpx.get(self.base + "/v1/mtplx/bank", headers=self.headers, timeout=10.0)
                if r.status_code == 200:
                    self.on_bank(r.json()["entries"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # the stream's own state says what is wrong; the next bank event retries
            time.sleep(0.2)
