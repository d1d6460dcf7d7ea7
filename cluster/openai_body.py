"""The HTTP API's request bodies: decoded as UTF-8 JSON whose every string is text, and their refusals
in OpenAI's terms.

A JSON body may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python
decodes into a ``str`` that no UTF-8 encoder (protobuf, the tokenizer) takes.
Such a body is refused with a 400 where the body is decoded
(``TextCheckedRoute``), naming the field that holds it, so that no field can
carry one further.  Pydantic's validation errors are put in the same words:
``field.part: what is wrong``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

# NOTE: a lone surrogate can only come from a \u escape of one (the body is decoded strictly); a body without
# any is not walked.  A pair that spells one character (an emoji) matches too: the walk tells them apart.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
NOT_AN_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"


class BodyTextError(StarletteHTTPException):
    """A request body that is not UTF-8 text: a 400 naming the field (``param``) where it is not."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


def check_text(data: Any) -> None:
    """``BodyTextError`` naming the first string of ``data`` (a decoded JSON document), key or value, that
    cannot be encoded as UTF-8."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise BodyTextError(f"{_dotted(path)}: {_not_text(value)}", path[0] if path else None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    where = f"{_dotted(path)}: a key" if path else "a key of the request body"
                    raise BodyTextError(f"{where} is {_not_text(key)}", path[0] if path else None)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, str(index)), item) for index, item in enumerate(value))


def _is_text(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _not_text(value: str) -> str:
    surrogate = next(c for c in value if "\ud800" <= c <= "\udfff")
    # NOTE: ascii(), not the character: the error body is JSON encoded as UTF-8 too.
    return f"not valid UTF-8 text (it holds the lone UTF-16 surrogate {ascii(surrogate)[1:-1]})"


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


class TextCheckedRequest(Request):
    """A request whose JSON body is decoded as strict UTF-8 and holds only text (``check_text``)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                text = (await self.body()).decode("utf-8")
            except UnicodeDecodeError:
                raise BodyTextError("the request body is not valid UTF-8") from None
            data = json.loads(text)  # FastAPI answers a JSONDecodeError itself
            if _SURROGATE_ESCAPE.search(text):
                check_text(data)
            self._json = data
        return self._json


class TextCheckedRoute(APIRoute):
    """A route whose handler reads its body through ``TextCheckedRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(TextCheckedRequest(request.scope, request.receive, request._send))

        return checked


def validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and ``param`` of a 400 for the body that ``exc`` refused: its first error, with the field."""
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is a character offset
        return "the request body is not valid JSON", None
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not location:  # the body itself: absent, not JSON (another content type), or not an object
        return NOT_AN_OBJECT, None
    if first.get("type") == "extra_forbidden":
        message = "unknown field; kvserve refuses it rather than ignore it (is it misspelled?)"
    else:
        message = first.get("msg", "invalid")
    return f"{_dotted(tuple(location))}: {message}", location[0]
