"""A request's body, read with the size limit enforced while it arrives and decompressed when the
client compressed it.

Reading it whole before checking its size would let one oversized upload (a buggy client that
attaches a disk image, a scanner) take the server's memory. A body sent with `Content-Encoding:
gzip` or `deflate` is inflated, bounded by the same limit (a small compressed body may expand to
gigabytes); other encodings are refused with 415 rather than parsed as broken JSON.
"""

from __future__ import annotations

import zlib

from mtplx.server.api_error import ApiError
from mtplx.server.openai_request import MAX_BODY

INFLATE = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _too_large(size: int | str) -> ApiError:
    return ApiError(413, f"request body is {size} bytes; the limit is {MAX_BODY}", code="body_too_large")


async def read_body(request) -> bytes:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity") and encoding not in INFLATE:
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported (send the body plain, gzip or deflate)",
                       code="unsupported_encoding")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large(int(declared))
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise _too_large(f"over {MAX_BODY}")
        parts.append(chunk)
    raw = b"".join(parts)
    if encoding in INFLATE:
        inflater = zlib.decompressobj(INFLATE[encoding])
        try:
            raw = inflater.decompress(raw, MAX_BODY + 1)
        except zlib.error as exc:
            raise ApiError(400, f"request body is not valid {encoding} ({exc})") from None
        if len(raw) > MAX_BODY or inflater.unconsumed_tail:
            raise _too_large(f"over {MAX_BODY} once inflated")
    return raw
