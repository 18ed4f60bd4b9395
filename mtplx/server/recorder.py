"""Opt-in recording of what clients send: `MTPLX_RECORD_DIR=DIR` writes each request's body and
headers (credentials redacted) to DIR/NNNN-<route>.json, for building client fixtures.
It knows requests, never generation; a failed write is logged, never fails the request."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("mtplx.server")
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}


class Recorder:
    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory else None
        self.counter = itertools.count(1)

    @classmethod
    def from_env(cls) -> "Recorder":
        return cls(os.environ.get("MTPLX_RECORD_DIR") or None)

    def record(self, method: str, path: str, headers, raw: bytes) -> None:
        if self.directory is None:
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        entry = {"method": method, "path": path, "time": time.time(),
                 "headers": {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()},
                 "body": body}
        name = f"{next(self.counter):04d}-{path.strip('/').replace('/', '_')}.json"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / name).write_text(json.dumps(entry, indent=1, ensure_ascii=False))
        except OSError:
            log.exception("could not record a request to %s", self.directory)
