"""HTTP transports that hand requests to an ASGI app in this process and stream its responses back.

httpx's (and httpx2's) `ASGITransport` collects the whole response body before it returns, so a server-sent
event stream would arrive in one piece at the end. These transports return as soon as the app has sent its
status line and pass each body chunk on as the app sends it. Closing a response early tells the app that the
client went away (`http.disconnect`), as a closed socket tells uvicorn, so the generation is aborted.

They are written against an httpx-like module (`httpx` or `httpx2`, whichever the `openai` client uses): both
have the same transport and stream types. `AsyncASGITransport` runs on the caller's event loop (asyncio or
trio); `SyncASGITransport` serves threads without an event loop by running each exchange on the loop where the
engine lives, through `call(async_fn, *args)` (an anyio portal or `anyio.from_thread.run` with a token).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, MutableMapping

import anyio
import sniffio

logger = logging.getLogger(__name__)

ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]
Call = Callable[..., Any]  # call(async_fn, *args) -> its result, run on the engine's event loop

_BUFFERED_CHUNKS = 16  # body chunks the app may send ahead of a slow reader before its `send` waits
IN_PROCESS = "vx.in_process"
"""The ASGI scope extension that marks a request from these transports: the app that embeds the engine, held to no
per-client share by the request guard (a network client cannot set a scope extension)."""


class _AppFailed(Exception):
    """The app raised after it had started its response: the connection would just break."""


class _Exchange:
    """One request to the app: runs the app in a task of its own, and carries its messages to the reader."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: AsyncIterator[bytes]) -> None:
        self.app, self.scope, self.body = app, scope, body
        self.sender, self.messages = anyio.create_memory_object_stream[tuple[str, Any]](_BUFFERED_CHUNKS)
        self.disconnected = anyio.Event()
        self.request_complete = False

    async def run(self) -> None:
        """The app's task: every outcome reaches the reader as a message, so nothing escapes the task."""
        try:
            await self.app(self.scope, self._receive, self._send)
        except Exception as e:  # noqa: BLE001 - logged like uvicorn does, then the reader is told
            logger.exception("vx in-process server: the app failed on %s %s", self.scope["method"], self.scope["path"])
            await self._put(("error", e))
        finally:
            self.sender.close()

    async def _receive(self) -> dict[str, Any]:
        if not self.request_complete:
            try:
                chunk = await self.body.__anext__()
            except StopAsyncIteration:
                self.request_complete = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await self._put(("start", message))
        elif message["type"] == "http.response.body":
            more = message.get("more_body", False)
            await self._put(("body", (message.get("body", b""), more)))
            if not more:
                self.disconnected.set()  # as httpx does: the exchange is over, a watcher of the client may stop

    async def _put(self, item: tuple[str, Any]) -> None:
        # Like uvicorn, a send to a client that went away is dropped, never an error for the app.
        try:
            await self.sender.send(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    def close(self) -> None:
        """The reader is done (or gone): the app sees `http.disconnect`."""
        self.disconnected.set()
        self.messages.close()


def _spawn(run: Callable[[], Awaitable[None]], tasks: set[Any]) -> None:
    """Start `run()` as a task that outlives the call: the response body is read after the transport returns.

    `run` never raises (but for cancellation), as a trio system task must not."""
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(run)
        return
    import asyncio

    task = asyncio.get_running_loop().create_task(run())
    tasks.add(task)  # the loop keeps only a weak reference to its tasks
    task.add_done_callback(tasks.discard)


def _scope(request: Any) -> dict[str, Any]:
    """The ASGI scope of an httpx request, as httpx's own ASGITransport builds it."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "headers": [(k.lower(), v) for k, v in request.headers.raw], "scheme": request.url.scheme,
        "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query, "server": (request.url.host, request.url.port),
        "client": ("127.0.0.1", 0), "root_path": "", "extensions": {IN_PROCESS: {}},
    }


def async_transport(http: ModuleType, app: ASGIApp, on_close: Callable[[], Awaitable[None]] | None = None) -> Any:
    """An `http.AsyncBaseTransport` serving requests with `app` on the caller's event loop."""

    class Body(http.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, exchange: _Exchange) -> None:
            self.exchange = exchange

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for kind, payload in self.exchange.messages:
                if kind == "error":
                    raise http.ReadError(f"The in-process vx server failed mid-response: {payload}") from payload
                chunk, more = payload
                if chunk:
                    yield chunk
                if not more:
                    return
            # As a connection closed mid-body would be: the app returned without finishing its response.
            raise http.ReadError("The in-process vx server ended its response before the end of its body.")

        async def aclose(self) -> None:
            self.exchange.close()

    class Transport(http.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            self.tasks: set[Any] = set()

        async def handle_async_request(self, request: Any) -> Any:
            exchange = _Exchange(app, _scope(request), request.stream.__aiter__())
            _spawn(exchange.run, self.tasks)
            try:
                kind, payload = await exchange.messages.receive()
            except anyio.EndOfStream:
                kind, payload = "error", RuntimeError("the app sent no response")
            except BaseException:  # cancelled while waiting: the client went away
                exchange.close()
                raise
            if kind != "start":
                exchange.close()
                if isinstance(payload, Exception):  # as uvicorn answers an app that failed before its response
                    return http.Response(500, text="Internal Server Error", request=request)
                raise http.ReadError(f"The in-process vx server sent {kind!r} before its status line.")
            return http.Response(payload["status"], headers=payload.get("headers", []), stream=Body(exchange),
                                 request=request)

        async def aclose(self) -> None:
            if on_close is not None:
                await on_close()

    return Transport()


def sync_transport(http: ModuleType, inner: Any, call: Call, on_close: Callable[[], None] | None = None) -> Any:
    """An `http.BaseTransport` for threads without an event loop: each request runs through `inner` (from
    `async_transport`) on the engine's loop, through `call`. Calling it from that loop's own thread would
    deadlock, so `call` refuses that."""

    async def next_chunk(iterator: AsyncIterator[bytes]) -> bytes | None:
        try:
            return await iterator.__anext__()
        except StopAsyncIteration:
            return None

    class Body(http.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def __iter__(self) -> Iterator[bytes]:
            iterator = self.stream.__aiter__()
            while (chunk := call(next_chunk, iterator)) is not None:
                yield chunk

        def close(self) -> None:
            call(self.stream.aclose)

    class Transport(http.BaseTransport):  # type: ignore[name-defined,misc]
        def handle_request(self, request: Any) -> Any:
            body = request.read()  # a request body is small and already in memory
            copy = http.Request(request.method, request.url, headers=request.headers, content=body,
                                extensions=request.extensions)
            response = call(inner.handle_async_request, copy)
            return http.Response(response.status_code, headers=response.headers.raw, stream=Body(response.stream),
                                 request=request)

        def close(self) -> None:
            call(inner.aclose)
            if on_close is not None:
                on_close()

    return Transport()
