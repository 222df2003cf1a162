"""Client disconnects cancel the work: an SSE response and a runner for plain responses that both watch the
connection and cancel the generation when the client goes away (the engine then frees the request's blocks).

uvicorn never fails a `send` to a closed connection; the only sign of a client gone is an `http.disconnect`
message from `receive`, so each response listens for it beside the work.
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vx.serve.errors import APIError, unexpected_error

T = TypeVar("T")
Emit = Callable[[str], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()`, cancelled (raising `ClientDisconnected`) if the client disconnects first."""
    result: list[T] = []
    error: list[BaseException] = []
    disconnected = False
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            try:
                result.append(await work())
            except Exception as e:  # kept outside the task group, so callers see it unwrapped
                error.append(e)
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal disconnected
            await _wait_for_disconnect(receive)
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if disconnected and not result:
        raise ClientDisconnected()
    if error:
        raise error[0]
    return result[0]


class EventStreamResponse(Response):
    """A `text/event-stream` response fed by `produce(emit)`, where `emit(json_text)` sends one `data:` event.

    The status line goes out with the first event, so an error raised before it (a bad parameter found when
    the request is submitted) still becomes a proper 4xx JSON response; a later error becomes an error event.
    The stream ends with `data: [DONE]`. If the client disconnects, `produce` is cancelled and `on_disconnect`
    is called.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]],
                 on_disconnect: Callable[[], None] | None = None) -> None:
        self.produce = produce
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # proxies must not buffer a stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        lock = anyio.Lock()  # several choices may emit concurrently

        async def emit(data: str) -> None:
            nonlocal started
            async with lock:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    started = True
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        try:
            await run_until_disconnect(receive, lambda: self.produce(emit))
        except ClientDisconnected:
            if self.on_disconnect is not None:
                self.on_disconnect()
            return
        except Exception as e:  # noqa: BLE001 - every error reaches the client in OpenAI's shape
            err = e if isinstance(e, APIError) else unexpected_error(e, "a stream")
            if not started:
                await err.response()(scope, receive, send)
                return
            await emit(err.body().model_dump_json())
        await emit("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
