"""Running the app on a uvicorn server in a background thread (TUI, in-process replay, tests)."""

from __future__ import annotations

import socket
import threading
import time

from mtplx.server.listener import bind


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, sock: socket.socket | None = None):
        """Serve on `sock` when given (bound by the caller, so a busy port was reported before
        anything loaded), else on `port` (0 or None: any free port, bound here)."""
        import uvicorn

        self.app = app
        self.sock = sock or bind(host, port or 0)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.server.install_signal_handlers = lambda: None  # the owning app keeps its own handlers
        self.thread = threading.Thread(target=lambda: self.server.run(sockets=[self.sock]), name="mtplx-server",
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        watchers = getattr(self.app.state, "watchers", None)
        if watchers is not None:  # a watcher's stream never ends by itself (server/event_watch.py)
            watchers.close_all()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
