"""OpenAI's error shape for the HTTP API, and the pipeline's errors in the request's own terms.

``{"error": {"message", "type", "param", "code"}}``, with the type OpenAI gives each
HTTP status.  The request pipeline (``Frontend.responses``) names the gRPC API's
fields; :func:`frontend_error_response` renames them as the request spelled them
(``FieldNames``: ``prompt`` or ``messages``, ``max_tokens`` or ``max_completion_tokens``).

``code`` is, as in OpenAI's own errors, a string naming the error (``model_not_found``) or null,
never the HTTP status: the status is the response's, and ``type`` names it.  A pipeline's error
is the same object whether it is the body of an error status (before the first token) or the
last event of a stream that failed mid-way (``frontend_error_body``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from kvserve.cluster.frontend import FrontendError, InvalidRequestError
from kvserve.cluster.openai_protocol import error_body

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}

# The gRPC API's two spellings of a prompt: OpenAI's is one field.
_PROMPT_FIELDS = ("text", "token_ids")
_MAX_TOKENS = re.compile(r"\bmax_tokens\b")


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How one request names the fields that the pipeline's errors name: its prompt, and its limit of output
    tokens; ``max_tokens_default`` says what that limit is when the request gives none."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    max_tokens_default: str | None = None


COMPLETION_FIELDS = FieldNames()


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, type_=error_type(status), code=code, param=param),
        status_code=status,
    )


def frontend_error_response(error: FrontendError, fields: FieldNames = COMPLETION_FIELDS) -> JSONResponse:
    """``error`` as an error status: its HTTP status, ``frontend_error_body`` and, where a retry may
    succeed soon (429), ``Retry-After``."""
    headers = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return JSONResponse(frontend_error_body(error, fields), status_code=error.http_status, headers=headers)


def frontend_error_body(error: FrontendError, fields: FieldNames = COMPLETION_FIELDS) -> dict[str, Any]:
    """``error`` in OpenAI's terms: the pipeline's messages name the gRPC API's fields, which become the
    request's (``fields``)."""
    message = str(error).replace("sampling_params.", "")
    param = None
    if isinstance(error, InvalidRequestError):
        field = re.match(r"[a-z_]+\b", message)
        param = field[0] if field else None
        if param in _PROMPT_FIELDS:
            message = fields.prompt + message[len(param):]
            param = fields.prompt
        if _MAX_TOKENS.search(message):
            message = _MAX_TOKENS.sub(fields.max_tokens, message)
            if fields.max_tokens_default is not None:
                message += f" ({fields.max_tokens} was not given: it defaults to {fields.max_tokens_default})"
            if param == "max_tokens":
                param = fields.max_tokens
    return error_body(message, type_=error_type(error.http_status), param=param)


def error_type(status: int, default: str = "invalid_request_error") -> str:
    """OpenAI's error type of an HTTP status."""
    return _ERROR_TYPES.get(status, default)
