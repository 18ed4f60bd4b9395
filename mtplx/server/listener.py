"""The listening socket, bound before the model loads: a busy port fails at once with one clear
line (instead of after a long load, or by silently serving elsewhere). Port 0 means any free port.
"""

from __future__ import annotations

import socket

from mtplx.errors import MtplxError


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise MtplxError(f"port {port} on {host} is in use (another mtplx serve?): stop it, or pass "
                             f"--port N (--port 0 picks a free one)") from None
        raise MtplxError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
