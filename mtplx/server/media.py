"""Images, documents and other media a client attaches, for a text-only model: a short
placeholder that says what was there (kind, type, size) instead of a 400 that would break every
later turn of the session holding it. A vision model would take them as input instead.

What is text already is given as text: an Anthropic document whose source is plain text (or
text blocks), and a search result (its title, source and text), so their content reaches the
model instead of a placeholder."""

from __future__ import annotations

ANTHROPIC_ATTACHMENTS = {"image", "document", "search_result"}
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


def _texts(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def attached(block: dict) -> str:
    """The block as the model reads it: its text where it has one, else a placeholder."""
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    title = block.get("title") if isinstance(block.get("title"), str) else None
    if block.get("type") == "search_result":
        head = " — ".join(x for x in (title, block.get("source") if isinstance(block.get("source"), str) else None) if x)
        return f"[search result{': ' + head if head else ''}]\n{_texts(block.get('content'))}"
    if block.get("type") == "document" and source.get("type") in ("text", "content"):
        text = source.get("data") if source.get("type") == "text" else _texts(source.get("content"))
        if isinstance(text, str):
            return f"[document{' ' + repr(title) if title else ''}]\n{text}"
    return placeholder(block)
