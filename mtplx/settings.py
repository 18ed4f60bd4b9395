"""User settings in $MTPLX_HOME/settings.json; today: each model's tuned decoding default."""

from __future__ import annotations

import json
import os

from mtplx.home import home_path


def _file():
    return home_path("settings.json")


def load_settings() -> dict:
    try:
        data = json.loads(_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}  # missing or damaged settings fall back to built-in defaults


def save_settings(settings: dict) -> None:
    """Written aside, then renamed: a full disk or a crash leaves the old file whole (and raises)."""
    path = _file()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # this process's own: never a mix of two writers
    try:
        tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tuned_default(identity: str) -> dict | None:
    """{"mtp": bool, "depth": int} measured by `mtplx tune` for this model identity, if any.
    An entry of another shape (a hand-edited file) counts as none: the built-in defaults apply."""
    tuned = load_settings().get("tuned")
    entry = tuned.get(identity) if isinstance(tuned, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("mtp"), bool):
        return None
    depth = entry.get("depth")
    return entry if isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 8 else None


def store_tuned(identity: str, mtp: bool, depth: int, measured: dict) -> None:
    settings = load_settings()
    if not isinstance(settings.get("tuned"), dict):
        settings["tuned"] = {}
    settings["tuned"][identity] = {"mtp": mtp, "depth": depth, "measured": measured}
    save_settings(settings)
