"""Errors as OpenAI sends them: an HTTP status and `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; the app's exception handlers (installed by `install_error_handlers`) turn it, and
FastAPI's own validation and routing errors, into that shape, so every client sees one error format. An
unexpected error is logged with its traceback and a reference; the client gets the reference, never the
error's class, message or file paths.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vx.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {503: "service_unavailable", 500: "internal_error"}  # every 4xx is an invalid_request_error


class APIError(Exception):
    """An error to send to the client: `status` is the HTTP status, the rest fills the error body."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
        self.headers = headers  # e.g. Retry-After, or Connection: close for a body left unread

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for input the client can fix."""
    return APIError(message, 400, param=param)


def unexpected_error(exc: BaseException, where: str) -> APIError:
    """The answer to an error no check caught, logged with its traceback and a reference, which is all the
    client learns (no class names, messages or paths): a 500, but a 400 for input nested too deeply for some
    parser (the checks bound nesting; this is the net under them)."""
    ref = uuid.uuid4().hex[:12]
    logger.error("vx serve: unexpected error on %s (reference %s)", where, ref, exc_info=exc)
    if isinstance(exc, RecursionError):
        return bad_request(f"The request nests too deeply to be processed (reference {ref}).")
    return APIError(f"Internal server error (reference {ref}; the server log has the details).", 500)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("The request body is not valid.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"{param or 'body'}: {msg}{more}", param)


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Send every error in OpenAI's shape. `on_error(request, status)` is called for each (for metrics)."""

    def note(request: Request, status: int) -> None:
        if on_error is not None:
            on_error(request, status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        note(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation_error(exc)
        note(request, err.status)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(str(exc.detail), exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = unexpected_error(exc, request.url.path)
        note(request, err.status)
        return err.response()
