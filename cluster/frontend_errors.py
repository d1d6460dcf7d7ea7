"""What the front end answers a request it cannot serve: one exception type per answer.

Each carries its gRPC status code and its HTTP status, so that each front door
maps them in one line.
"""

from __future__ import annotations

import grpc

__all__ = [
    "FrontendError", "InvalidRequestError", "OverloadedError", "PermissionDeniedError", "UnauthenticatedError",
    "UnavailableError",
]


class FrontendError(Exception):
    """A request the front end cannot serve; each subclass is one answer (gRPC status, HTTP status)."""

    grpc_code = grpc.StatusCode.UNKNOWN
    http_status = 500
    # Seconds an HTTP client should wait before it tries again (its ``Retry-After`` header); None: no header.
    retry_after_s: int | None = None


class InvalidRequestError(FrontendError, ValueError):
    """A request that can never be served as sent; the message names the field."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class DuplicateRequestError(InvalidRequestError):
    """A request whose ``request_id`` names one in flight (its tenant's, with authentication)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class OverloadedError(FrontendError):
    """``max_concurrent_requests`` streams are in flight already (the server's, or the tenant's)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    # A slot frees when any stream ends, which for a short completion is well within a second; the
    # openai SDK's retries honour the header (its own default back-off starts at 0.5 s).
    retry_after_s = 1


class UnavailableError(FrontendError):
    """No replica can serve the request now (the scheduler is gone, the replica failed)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class UnauthenticatedError(FrontendError):
    """A request without a valid bearer token (the server has an auth token file)."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDeniedError(FrontendError):
    """A valid token whose tenant may not do this (read the cluster's monitoring figures)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
