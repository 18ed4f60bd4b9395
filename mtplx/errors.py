"""The one error family. The core raises these naming the offending value; edges render them."""

from __future__ import annotations


class MtplxError(Exception):
    """Base of every error mtplx raises on purpose."""


class ModelLoadError(MtplxError):
    """A model directory is missing, malformed or of an unsupported kind."""


class RequestError(MtplxError, ValueError):
    """A generation request is invalid (bad sampling value, empty prompt, too long, ...)."""


class EngineStopped(MtplxError):
    """The engine thread is not running, so nothing can be submitted."""
