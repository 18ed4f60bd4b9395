"""Images, documents and other media a client attaches, for a text-only model: a short
placeholder that says what was there (kind, type, size) instead of a 400 that would break every
later turn of the session holding it. A vision model would take them as input instead."""

from __future__ import annotations

ANTHROPIC_MEDIA = {"image", "document"}
OPENAI_MEDIA = {"image_url", "input_image", "input_audio", "file", "input_file"}


def placeholder(block: dict) -> str:
    kind = block.get("type", "media")
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    what = source.get("media_type") or source.get("type") or ""
    data = source.get("data") or source.get("url") or ""
    if kind in ("image_url", "input_image"):
        url = block.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        data = url if isinstance(url, str) else ""
        what = data[5:].split(";", 1)[0] if data.startswith("data:") else "url"
        kind = "image"
    title = block.get("title") or (block.get("file") or {}).get("filename") if isinstance(block.get("file"), dict) else block.get("title")
    size = f", {len(data)} chars" if isinstance(data, str) and data and not data.startswith("http") else ""
    label = f"{kind}" + (f" {title!r}" if isinstance(title, str) and title else "") + (f" ({what}{size})" if what else "")
    return f"[{label} attached; this model reads text only]"
