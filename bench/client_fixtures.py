"""Recorded client requests (MTPLX_RECORD_DIR, or bench/agents.py --record) -> trimmed test
fixtures under tests/fixtures/clients/<client>/: long texts cut to 300 characters and tools to
the first four plus the first of every other tool kind, so the in-process tests replay each
client's request *shape* (fields, roles, block kinds, tool kinds, headers) on the tiny model's
window in seconds.

    python bench/client_fixtures.py RECORD_DIR CLIENT [--max N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "clients"
KEEP_HEADERS = {"user-agent", "session-id", "thread-id", "x-claude-code-session-id", "anthropic-version", "anthropic-beta",
                "x-session-affinity", "originator", "content-type", "accept"}


def trim(value, limit: int = 300):
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + " [...]"
    if isinstance(value, list):
        return [trim(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: (v if k in ("data",) and isinstance(v, str) and len(v) < 64 else trim(v, limit)) for k, v in value.items()}
    return value


def trim_request(entry: dict) -> dict:
    body = dict(entry["body"])
    if isinstance(body.get("tools"), list):  # the first four, and the first of every other kind
        kinds = {t.get("type") for t in body["tools"][:4] if isinstance(t, dict)}
        extra = [t for t in body["tools"][4:] if isinstance(t, dict) and t.get("type") not in kinds
                 and not kinds.add(t.get("type"))]
        body["tools"] = body["tools"][:4] + extra
    return {"method": entry["method"], "path": entry["path"],
            "headers": {k: v for k, v in entry["headers"].items() if k.lower() in KEEP_HEADERS}, "body": trim(body)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path)
    parser.add_argument("client")
    parser.add_argument("--max", type=int, default=4)
    args = parser.parse_args()
    out = OUT / args.client
    out.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(sorted(args.record.glob("*.json"))[: args.max]):
        entry = trim_request(json.loads(path.read_text()))
        (out / path.name).write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
        print(out / path.name)


if __name__ == "__main__":
    main()
