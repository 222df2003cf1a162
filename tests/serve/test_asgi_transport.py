"""The in-process transports (vx/serve/asgi_transport.py) with small ASGI apps: a body streams chunk by chunk,
closing a response early is an `http.disconnect` for the app, an app that fails is a 500 (before its response)
or a read error (during it), and the sync transport runs exchanges on an event loop from other threads. For
httpx and httpx2 (what openai 1-2 and openai 3 are built on), on asyncio and trio."""

from __future__ import annotations


import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from vx.serve.asgi_transport import async_transport, sync_transport

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(params=["httpx", "httpx2"])
def http(request):
    return pytest.importorskip(request.param)


class App:
    """Sends `first`, then waits for the test's `go` before sending `second` and ending (or failing)."""

    def __init__(self, fail: str | None = None) -> None:
        self.go = anyio.Event()
        self.disconnected = anyio.Event()
        self.fail = fail

    async def __call__(self, scope, receive, send) -> None:
        assert (await receive())["type"] == "http.request"
        if self.fail == "before":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-test", b"1")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass  # the rest of the request body
                self.disconnected.set()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await self.go.wait()
            if self.fail == "during":
                raise RuntimeError("boom")
            await send({"type": "http.response.body", "body": b"second", "more_body": False})
            tg.cancel_scope.cancel()


async def test_a_body_streams_and_an_early_close_disconnects(http):
    app = App()
    async with http.AsyncClient(transport=async_transport(http, app), base_url="http://t") as client:
        with anyio.fail_after(5):  # a buffering transport would wait for `go` forever
            async with client.stream("POST", "/", content=b"{}") as response:
                assert response.status_code == 201 and response.headers["x-test"] == "1"
                chunks = response.aiter_bytes()
                assert await chunks.__anext__() == b"first"
                app.go.set()
                assert await chunks.__anext__() == b"second"

    app = App()
    async with http.AsyncClient(transport=async_transport(http, app), base_url="http://t") as client:
        with anyio.fail_after(5):
            async with client.stream("POST", "/", content=b"{}") as response:
                assert await response.aiter_bytes().__anext__() == b"first"
            await app.disconnected.wait()  # closed before the end: the app hears of it


async def test_an_app_that_fails(http):
    async with http.AsyncClient(transport=async_transport(http, App(fail="before")), base_url="http://t") as c:
        assert (await c.post("/", content=b"{}")).status_code == 500
    app = App(fail="during")
    app.go.set()
    async with http.AsyncClient(transport=async_transport(http, app), base_url="http://t") as c:
        with pytest.raises(http.ReadError):
            await c.post("/", content=b"{}")


def test_the_sync_transport_runs_on_a_loop_in_another_thread(http):
    app = App()
    with start_blocking_portal() as portal:
        transport = sync_transport(http, async_transport(http, app), portal.call)
        with http.Client(transport=transport, base_url="http://t") as client:
            with client.stream("POST", "/", content=b"{}") as response:
                chunks = response.iter_bytes()
                assert next(chunks) == b"first"
                portal.call(app.go.set)
                assert next(chunks) == b"second"
