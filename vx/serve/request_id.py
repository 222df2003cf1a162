"""`x-request-id` on every response: the request's own (echoed, so a client can match its logs to ours), else a
new one, as OpenAI and vLLM send it. An outer ASGI layer, so errors of every kind (the guard's 401/413/429, a
route's 400, an unexpected 500) carry it too."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_MAX_LEN = 256  # a longer client id is replaced: it would only bloat every log line and response


class RequestIdMiddleware:
    """Adds `x-request-id` to each HTTP response; the id is also kept in `scope["state"]["request_id"]`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        raw = request_id.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": headers + [(HEADER, raw)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(scope: Scope) -> str:
    """The client's `x-request-id` if it is short printable ASCII (safe to echo as a header), else a new id."""
    for key, value in scope.get("headers", []):
        if key == HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_LEN and text.isascii() and text.isprintable():
                return text
            break
    return uuid.uuid4().hex
