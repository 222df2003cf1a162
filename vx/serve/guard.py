"""The request guard: a pure ASGI middleware that decides whether a request gets in before any route runs, and
ends it properly when the server stops.

In order, for each HTTP request:
1. the server is stopping: 503 (`code: "shutting_down"`);
2. a `/v1/*` path without the API key: 401, before a byte of the body is read (a constant-time compare);
3. a generation request (POST completions, chat, responses or embeddings) beyond `max_concurrent_requests`, or
   beyond its client's share, `max_requests_per_client`: 429 with `Retry-After`;
4. a request with a body while its client is slow to send `max_slow_bodies_per_client` others (each arriving
   for over a second): 429 with `Retry-After`, so that a client that sends slowly cannot go on taking slots;
5. a `Content-Length` over `max_body_bytes`: 413 before the body is read;
6. the body is read with a running count, 413 as soon as it passes the limit (chunked bodies too, so memory
   never holds more than the limit), and within `body_timeout` seconds, 408 after that;
7. the body must be UTF-8 JSON text nested at most `max_json_depth` deep, with no lone surrogate: 400.
A client is its peer address (an IPv6 address's /64 prefix, what one host is usually given); in-process requests
(vx/serve/asgi_transport.py) belong to no client, so the app that embeds the engine is never held to a share.
A refusal that leaves a body unread closes the connection. Then the app runs inside a cancel scope registered
in `InFlight`: when the server ends it (after the shutdown grace period), the guard finishes the response, with
an error event and `data: [DONE]` for a stream already under way, or a 503.
"""

from __future__ import annotations

import ipaddress
import secrets

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vx.serve.asgi_transport import IN_PROCESS
from vx.serve.chat import ENDPOINT as CHAT_ENDPOINT
from vx.serve.completions import ENDPOINT as COMPLETIONS_ENDPOINT
from vx.serve.embeddings import ENDPOINT as EMBEDDINGS_ENDPOINT
from vx.serve.errors import APIError
from vx.serve.responses import ENDPOINT as RESPONSES_ENDPOINT
from vx.serve.state import ServerState
from vx.serve.validation import check_json_text

GENERATION_PATHS = frozenset({COMPLETIONS_ENDPOINT, CHAT_ENDPOINT, RESPONSES_ENDPOINT, EMBEDDINGS_ENDPOINT})  # run the engine
RETRY_AFTER_S = 1  # what a 429 asks the client to wait, in seconds
_FINISH_TIMEOUT_S = 2.0  # the last events to a client that reads nothing must not hold up the shutdown
_THREAD_CHECK_BYTES = 64 * 1024  # larger bodies are checked in a worker thread, so other streams keep flowing


class RequestGuard:
    """ASGI middleware applying `state.options` to every HTTP request of the app it wraps."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        generation = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        client = client_key(scope)
        refusal = self._admit(scope, generation, client)
        if refusal is not None:
            await self._refuse(refusal[0], refusal[1], scope, receive, send)
            return
        response = _ResponseTracker(send)
        # No await since the admission: the counts it read are the ones these increment.
        with self.state.inflight.track(generation, client) as cancel_scope:
            body = await self._read_body(scope, receive, response.send, client if _may_have_body(scope) else None)
            if body is not None:
                await self.app(scope, _replay(body, receive), response.send)
        if cancel_scope.cancelled_caught:
            await _finish(response, scope, receive)

    def _admit(self, scope: Scope, generation: bool, client: str | None) -> tuple[str, APIError] | None:
        """(reason, error) if the request (from `client`, None for one held to no share) is refused on its headers
        alone, else None."""
        state, options = self.state, self.state.options
        if state.inflight.draining:
            return "shutting_down", APIError("The server is shutting down; retry on another instance.", 503,
                                             code="shutting_down")
        path = scope["path"]
        if state.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(scope):
            return "unauthorized", APIError("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401,
                                            code="invalid_api_key")
        if generation and state.inflight.generating >= options.max_concurrent_requests:
            return "too_many_requests", APIError(
                f"The server is handling its limit of {options.max_concurrent_requests} requests; retry shortly.",
                429, code="too_many_requests", headers={"retry-after": str(RETRY_AFTER_S)})
        if client is not None:
            if generation and state.inflight.generating_for(client) >= options.max_requests_per_client:
                return "too_many_from_client", _over_share(
                    f"{options.max_requests_per_client} generation requests in flight", "max_requests_per_client")
            if _may_have_body(scope) and state.inflight.slow_bodies_for(client) >= options.max_slow_bodies_per_client:
                return "too_many_from_client", _over_share(
                    f"{options.max_slow_bodies_per_client} request bodies slow to arrive", "max_slow_bodies_per_client")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > options.max_body_bytes:
            return "too_large", _too_large(options.max_body_bytes)
        return None

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        assert self.state.api_key is not None
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode("latin-1"),
                                                                     self.state.api_key.encode())

    async def _read_body(self, scope: Scope, receive: Receive, send: Send, client: str | None) -> bytes | None:
        """The whole body, within the size limit and the body timeout, counted as arriving for `client` meanwhile;
        None once it was refused (or the client left)."""
        options = self.state.options
        chunks: list[bytes] = []
        size = 0
        refusal: tuple[str, APIError] | None = None
        with self.state.inflight.receiving_body(client), anyio.move_on_after(options.body_timeout) as timer:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None  # the client left: nobody to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > options.max_body_bytes:
                    refusal = ("too_large", _too_large(options.max_body_bytes))
                    break
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if timer.cancelled_caught:
            refusal = ("body_timeout", APIError(
                f"The request body did not arrive within {options.body_timeout:g} s.", 408, code="request_timeout"))
        if refusal is None:
            body = b"".join(chunks)
            refusal = await self._check_json(scope, body)
            if refusal is None:
                return body
        await self._refuse(refusal[0], refusal[1], scope, receive, send, body_read=refusal[0] == "invalid_json")
        return None

    async def _check_json(self, scope: Scope, body: bytes) -> tuple[str, APIError] | None:
        if not body or scope["method"] != "POST":
            return None
        try:
            if len(body) > _THREAD_CHECK_BYTES:
                await anyio.to_thread.run_sync(check_json_text, body, self.state.options.max_json_depth)
            else:
                check_json_text(body, self.state.options.max_json_depth)
        except APIError as e:
            return "invalid_json", e
        return None

    async def _refuse(self, reason: str, error: APIError, scope: Scope, receive: Receive, send: Send, *,
                      body_read: bool = False) -> None:
        self.state.metrics.rejected.labels(reason).inc()
        if not body_read and _may_have_body(scope):
            # The rest of the body is never read: the connection cannot carry another request.
            error.headers = {**(error.headers or {}), "connection": "close"}
        await error.response()(scope, receive, send)


class _ResponseTracker:
    """Passes the app's messages on, noting how far the response got, so that the guard can end it."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)


async def _finish(response: _ResponseTracker, scope: Scope, receive: Receive) -> None:
    """End a response the server stopped: a 503 if nothing was sent, else an error event and `[DONE]`."""
    error = APIError("The server is shutting down; the request was stopped.", 503, code="shutting_down")
    with anyio.move_on_after(_FINISH_TIMEOUT_S, shield=True):
        if not response.started:
            await error.response()(scope, receive, response.send)
        elif not response.complete:
            tail = f"data: {error.body().model_dump_json()}\n\ndata: [DONE]\n\n" if response.event_stream else ""
            await response.send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then passes on (disconnects)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


def client_key(scope: Scope) -> str | None:
    """Whose share a request counts against: its peer's IP address, or for IPv6 the address's /64 network (one
    host usually holds a whole /64); None for an in-process request, which counts against no share."""
    if IN_PROCESS in (scope.get("extensions") or {}):
        return None
    peer = scope.get("client")
    host = str(peer[0]) if peer else ""  # a Unix socket has no peer address: all its clients share one key
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


def _over_share(what: str, option: str) -> APIError:
    return APIError(f"This client already has {what}, its share of the server (--{option.replace('_', '-')}); "
                    "retry shortly.", 429, code="too_many_requests", headers={"retry-after": str(RETRY_AFTER_S)})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _may_have_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


def _too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than the server's limit of {limit} bytes.", 413,
                    code="request_too_large")

