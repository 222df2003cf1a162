"""`vx.openai_client(llm)`: the official `openai` client wired to an embedded engine, with no port and no server.

The client talks to the same app `vx serve` runs (`build_app`), through an in-process transport
(vx/serve/asgi_transport.py), so every framework that takes an OpenAI client (or an httpx client) runs on an
embedded vx with the server's behaviour: validation, tool calls, structured output, streaming, errors.

Lifecycle: the client never owns an engine it did not start. An `AsyncLLM` you started (`async with`) keeps
running after `client.close()`, and closing the `AsyncLLM` ends the client's requests cleanly (503, no retry).
Only a sync client made from an `AsyncLLM` that was not started (plain sync code has no event loop to run it)
starts the engine itself, on an event loop in a daemon thread, and stops it on `client.close()` or at exit.

This lives in vx/serve, not vx/client: it needs the server app, and vx/serve already imports vx/client, so the
other place would make a cycle (tests/test_import_directions.py).
"""

from __future__ import annotations

import functools
import importlib
import queue
import threading
import weakref
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
from anyio.from_thread import BlockingPortal

from vx.optional_dependencies import needs_extra

with needs_extra("vx.openai_client", "serve"):  # the server app it runs in-process: fastapi and the rest
    from vx.serve.app import build_app
    from vx.serve.asgi_transport import Call, async_transport, sync_transport
    from vx.serve.options import ServerOptions
    from vx.serve.template_sandbox import TemplateLimits

BASE_URL = "http://vx.local/v1"  # never resolved: the transport hands every request to the app
_PLACEHOLDER_KEY = "vx-in-process"  # the openai client insists on a key; the in-process app checks none


def openai_client(llm: Any, *, sync: bool = False, served_model_names: list[str] | None = None,
                  chat_template: str | None = None, options: ServerOptions | None = None,
                  chat_template_limits: TemplateLimits | None = None, **client_kwargs: Any) -> Any:
    """An `openai.AsyncOpenAI` (or, with `sync=True`, an `openai.OpenAI`) served in-process by `llm`.

    `llm` is a `vx.AsyncLLM`. The async client needs it started (`async with vx.AsyncLLM() as llm:`) and is
    used on that event loop. The sync client is for threads: made on the engine's loop (or in one of its anyio
    worker threads), it may be called from any other thread; made from sync code with an engine not yet started,
    it starts it (see the module's docstring). The app takes `vx serve`'s settings (`served_model_names`,
    `chat_template`, `options`, `chat_template_limits`); `client_kwargs` go to the openai client (e.g.
    `timeout`); `max_retries` defaults to 0, as there is no network to be flaky.
    """
    openai = _import_openai()
    http = _http_module(openai)
    app = build_app(llm, served_model_names=served_model_names, chat_template=chat_template, start_engine=False,
                    options=options, chat_template_limits=chat_template_limits)
    close_templates = app.state.vx.templates.aclose  # the renderer processes: started on first use
    client_kwargs.setdefault("max_retries", 0)
    client_kwargs.setdefault("api_key", _PLACEHOLDER_KEY)
    inner = async_transport(http, app, on_close=close_templates)
    if not sync:
        if llm.config is None:
            raise RuntimeError("Start the engine before making its async client: "
                               "`async with vx.AsyncLLM() as llm: client = vx.openai_client(llm)`.")
        return openai.AsyncOpenAI(base_url=BASE_URL, http_client=openai.DefaultAsyncHttpxClient(transport=inner),
                                  **client_kwargs)
    owned = None
    if llm.config is None:
        owned = _EngineThread(llm)
        call: Call = owned.call
    else:
        call = _call_on_engine_loop()
    transport = sync_transport(http, inner, call, on_close=owned.close if owned is not None else None)
    client = openai.OpenAI(base_url=BASE_URL, http_client=openai.DefaultHttpxClient(transport=transport),
                           **client_kwargs)
    if owned is not None:  # a client dropped unclosed, or still open at exit, stops the engine it started
        weakref.finalize(client, owned.close)
    return client


def _import_openai() -> ModuleType:
    try:
        return importlib.import_module("openai")
    except ImportError:
        raise ImportError("vx.openai_client needs the `openai` package: pip install openai") from None


def _http_module(openai: ModuleType) -> ModuleType:
    """`httpx2` or `httpx`: whichever module the installed openai client is built on (openai 3 moved to httpx2)."""
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    return importlib.import_module(base.__module__.split(".")[0])


def _call_on_engine_loop() -> Call:
    """`call(async_fn, *args)` running on the event loop of a started engine, from any other thread."""
    try:
        token = anyio.lowlevel.current_token()  # made on the engine's loop
        loop_thread = threading.get_ident()
    except RuntimeError:
        try:  # made in one of the loop's anyio worker threads
            token, loop_thread = anyio.from_thread.run_sync(lambda: (anyio.lowlevel.current_token(),
                                                                     threading.get_ident()))
        except RuntimeError:
            raise RuntimeError("Make the sync client on the engine's event loop (or in one of its anyio worker "
                               "threads), then use it from other threads.") from None

    def call(fn: Any, *args: Any) -> Any:
        if threading.get_ident() == loop_thread:
            raise RuntimeError("The sync vx client was called on the event loop that runs the engine, which it "
                               "would block for good: use the async client there (vx.openai_client(llm)), or call "
                               "this one from a worker thread (anyio.to_thread.run_sync, asyncio.to_thread).")
        return anyio.from_thread.run(fn, *args, token=token)

    return call


class _EngineThread:
    """An event loop in a daemon thread running an `AsyncLLM` for sync code; `close()` stops the engine, then
    the loop. A daemon thread, so that an unclosed one never holds up the interpreter's exit."""

    def __init__(self, llm: Any) -> None:
        ready: queue.Queue[BlockingPortal] = queue.Queue()
        self._thread = threading.Thread(target=anyio.run, args=(self._serve, ready), name="vx-engine-loop",
                                        daemon=True)
        self._thread.start()
        self.portal = ready.get()
        self._lock = threading.Lock()
        self._engine = self.portal.wrap_async_context_manager(llm)  # entered and left in one task of the loop
        try:
            self._engine.__enter__()
        except BaseException:
            self._stop_loop()
            raise
        self._open = True

    @staticmethod
    async def _serve(ready: queue.Queue[BlockingPortal]) -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    def call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
        try:
            self._engine.__exit__(None, None, None)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.portal.call(functools.partial(self.portal.stop, cancel_remaining=True))
        self._thread.join(timeout=30)
