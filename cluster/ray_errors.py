"""The message of an exception raised inside a Ray actor, without Ray's wrapping."""

from __future__ import annotations


def remote_error_message(exc: BaseException) -> str:
    """``str`` of the exception the remote method raised (Ray wraps it with a traceback)."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)
