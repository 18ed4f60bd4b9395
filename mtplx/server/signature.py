"""Signatures for the thinking blocks mtplx returns: an HMAC over the thinking text with a key
kept under MTPLX_HOME, so a block a client sends back is recognised as this install's own
reasoning (and rendered as reasoning again) rather than taken on trust. Opaque to clients."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
from pathlib import Path
from typing import Callable

PREFIX = "mtplx1."
log = logging.getLogger(__name__)


class Signer:
    """`where()` gives the key file: asked on first use, so building an app writes nothing."""

    def __init__(self, where: Callable[[], Path] | None = None, key: bytes | None = None):
        self.where, self._key = where, key

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = _load_or_create(self.where())
        return self._key

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self.key, thinking.encode("utf-8"), hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def verify(self, thinking: str, signature) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(thinking), signature)

    def seal(self, thinking: str) -> str:
        """The text with its signature, for clients that keep only an opaque blob (the Responses
        API's `encrypted_content`, which Codex sends back while dropping the readable text)."""
        return self.sign(thinking) + "." + base64.urlsafe_b64encode(thinking.encode("utf-8")).decode()

    def unseal(self, blob) -> str | None:
        """The text of a blob this install sealed, else None."""
        if not isinstance(blob, str) or not blob.startswith(PREFIX) or blob.count(".") < 2:
            return None
        signature, data = blob.rsplit(".", 1)
        try:
            text = base64.urlsafe_b64decode(data.encode()).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
        return text if self.verify(text, signature) else None


KEY_BYTES = 32


def _load_or_create(path: Path) -> bytes:
    """The install's key at `path`, created (0600) on first use.

    The file appears whole or not at all (written aside, then linked into place, which also lets
    exactly one of two starting servers create it). A file of the wrong size (a write cut short
    before this was so) is replaced. Where nothing can be written (a full or read-only disk) the
    key lives in memory: this process's signatures then do not outlast it."""
    try:
        key = path.read_bytes()
        if len(key) == KEY_BYTES:
            return key
        log.warning("signing key %s has %d bytes, not %d: replaced", path, len(key), KEY_BYTES)
        path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    except OSError as exc:  # unreadable where it should be (no folder, no permission): this run's key
        log.warning("signing key %s unreadable (%s): thinking signatures last until this server stops", path, exc)
        return os.urandom(KEY_BYTES)
    key = os.urandom(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another server made it first: use that one
            return _load_or_create(path)
        except OSError:  # a file system without hard links (exFAT): renamed instead, still whole
            os.replace(tmp, path)
        return key
    except OSError as exc:
        log.warning("signing key not saved (%s): thinking signatures last until this server stops", exc)
        return key
    finally:
        tmp.unlink(missing_ok=True)
