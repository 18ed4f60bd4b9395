"""Which web pages may call the endpoint from a browser (CORS).

A browser front end (a chat UI served on localhost:3000, a notebook, a dev tool) sends a preflight
OPTIONS before its POST and reads the answer only when the response names its origin. Without
CORS headers such a page cannot use the endpoint at all; with `*` any site the user visits could
drive the local model and read its answers. So, as local model servers that care about this do,
pages served from this machine (localhost, 127.0.0.1, [::1], any port, http or https) are allowed
by default, and `--cors-origin` adds others (`*`: any). A preflight is answered before the API key
check, as browsers send it without credentials; the request that follows still needs the key.
"""

from __future__ import annotations

import re

LOCAL = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?"


def install(app, origins: tuple[str, ...] = ()) -> None:
    """After every other middleware, so it is the outermost (a preflight never reaches the key check)."""
    from starlette.middleware.cors import CORSMiddleware

    if "*" in origins:
        pattern = r".*"
    else:
        pattern = "|".join([LOCAL] + [re.escape(o.rstrip("/")) for o in origins])
    app.add_middleware(CORSMiddleware, allow_origin_regex=f"(?:{pattern})", allow_methods=["GET", "POST", "DELETE"],
                       allow_headers=["*"], max_age=600)
