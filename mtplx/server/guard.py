"""The server's outer layer, as plain ASGI: the API key check, per-route status counts, and the
answer to an error no route caught (shaped as the route's API shapes its errors)."""

from __future__ import annotations

import hmac
import logging
import os
import uuid

from fastapi.responses import JSONResponse

from mtplx.server import anthropic_map
from mtplx.server.api_error import ApiError
from mtplx.server.metrics import Metrics

log = logging.getLogger("mtplx.server")


def _route_of(app, scope) -> str:
    """The route a request matched, as declared ("/v1/models/{model_id:path}"), or "unmatched": a
    metrics label per raw path would grow with every path a scanner tries (and a path may hold a
    quote that breaks the Prometheus text)."""
    from starlette.routing import Match

    for route in getattr(app, "routes", ()):
        if route.matches(scope)[0] is Match.FULL:
            return route.path
    return "unmatched"


def shaped(path: str, err: ApiError) -> JSONResponse:
    """The Anthropic routes answer errors in Anthropic's shape, the others in OpenAI's."""
    anthropic = path.startswith("/v1/messages")
    code = err.code if err.status < 500 else None  # a 500's code is its request id, already in the message
    return JSONResponse(anthropic_map.error_body(err.status, err.message, code=code) if anthropic else err.body(),
                        status_code=err.status)


def internal_error(path: str, exc: BaseException) -> JSONResponse:
    rid = "req_" + uuid.uuid4().hex[:12]
    log.error("internal error %s on %s", rid, path, exc_info=exc)
    detail = f": {type(exc).__name__}: {exc}" if os.environ.get("MTPLX_DEBUG_ERRORS") == "1" else ""
    return shaped(path, ApiError(500, f"internal server error (request id {rid}){detail}", None, "server_error", rid))


class Guard:
    """The API key check and per-route status counts, as plain ASGI: Starlette's function
    middleware wraps `receive`, which hides a client's disconnect from the handler (a dropped
    non-streaming request would then run to its end)."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, router=None):
        self.app, self.api_key, self.metrics, self.router = app, api_key, metrics, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = _route_of(self.router, scope)
        if self.api_key and scope["path"] != "/health":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key")
            # compared in constant time: how long a wrong key takes must not tell how much of it was right
            if given is None or not hmac.compare_digest(given.encode("latin-1"), self.api_key.encode("utf-8")):
                body = ApiError(401, "missing or wrong API key", None, "authentication_error").body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                self.metrics.request(path, 401)
                return
        status = 500
        started = False

        async def send_counted(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception as exc:
            if started:  # a stream cut short: only closing the connection tells the client
                raise
            # Answered here rather than by Starlette's outermost handler, which re-raises after
            # its 500 and so makes uvicorn drop the connection: a client's next request on that
            # kept-alive connection would then fail with a reset instead of being served.
            await internal_error(scope["path"], exc)(scope, receive, send_counted)
        finally:
            self.metrics.request(path, status)
