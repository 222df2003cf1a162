"""Chat templates rendered off the event loop, in a small pool of renderer processes with time, memory and size caps.

A jinja template is a program: a loop nest can run for hours and one expression (`'a' * 10**9`) can allocate
gigabytes, and jinja's sandbox bounds neither. A thread cannot be stopped, so rendering happens in processes
(vx/serve/template_worker.py): started on first use, reused, killed and replaced when a render overruns its time.
A render that fails or hits a limit raises `TemplateRenderError`; when no renderer can be started,
`RendererUnavailable`. Request-supplied templates may hold at most `workers - 1` processes, so that the server's own
template always finds one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from vx.serve.template_worker import READY, RenderReply, RenderRequest

_START_TIMEOUT_S = 60.0  # a worker imports transformers' renderer (about a second, more on a busy machine)
_HEADER_SIZE = 4


@dataclass(frozen=True)
class TemplateLimits:
    """What rendering one chat template may cost (`vx serve --chat-template-*` flags)."""

    timeout_s: float = 2.0  # wall clock, from sending the render to its result
    max_output_chars: int = 16 * 2**20  # the rendered prompt (twice the default request body limit)
    max_memory_mb: int = 512  # what a renderer may allocate beyond its baseline (RLIMIT_AS)
    workers: int = 2  # renderer processes at most

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"chat template timeout must be > 0 s, got {self.timeout_s}.")
        for name in ("max_output_chars", "max_memory_mb", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"chat template {name} must be >= 1, got {getattr(self, name)}.")


class TemplateRenderError(ValueError):
    """The template failed on these messages, or hit a limit (`limit`: "timeout", "output", "memory")."""

    def __init__(self, message: str, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit


class RendererUnavailable(RuntimeError):
    """No renderer process could be started."""


class _Worker:
    """One renderer process and its framed pipes."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin = proc.stdin
        self.stdout = BufferedByteReceiveStream(proc.stdout)
        self.ready = False  # it sent READY: its imports are done and its limits set

    async def wait_ready(self) -> None:
        """Wait for READY (once); `RendererUnavailable` if it does not come."""
        if self.ready:
            return
        try:
            with anyio.fail_after(_START_TIMEOUT_S):
                first = await self.receive()
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as e:
            raise RendererUnavailable("The chat template renderer did not start (see the server log).") from e
        if first != READY:
            raise RendererUnavailable(f"The chat template renderer sent {first[:40]!r} instead of ready.")
        self.ready = True

    async def send(self, body: bytes) -> None:
        await self.stdin.send(len(body).to_bytes(_HEADER_SIZE, "big") + body)

    async def receive(self) -> bytes:
        size = int.from_bytes(await self.stdout.receive_exactly(_HEADER_SIZE), "big")
        return await self.stdout.receive_exactly(size)

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError):  # it may have exited on its own
                self.proc.kill()
            await self.proc.wait()
            await self.proc.aclose()


class TemplateSandbox:
    """Renders chat templates in renderer processes under `limits`; `aclose()` stops them."""

    def __init__(self, limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._slots = anyio.CapacityLimiter(self.limits.workers)
        self._request_slots = anyio.CapacityLimiter(max(1, self.limits.workers - 1))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(RenderReply)

    async def render(self, template: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool, variables: dict[str, Any], trusted: bool) -> str:
        """The prompt text, as `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders it.

        `variables` are the tokenizer's special tokens; `trusted` is False for a template the request brought.
        """
        try:
            body = self._encoder.encode(RenderRequest(template=template, messages=messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      variables=variables))
        except (OverflowError, TypeError, msgspec.EncodeError) as e:  # e.g. an int past 64 bits in a message
            raise TemplateRenderError(f"The messages hold a value the chat template cannot be given: {e}") from None
        async with self._slot(trusted):
            worker = self._idle.pop() if self._idle else await self._start()
            reusable = False
            try:
                await worker.wait_ready()
                with anyio.move_on_after(self.limits.timeout_s) as scope:
                    await worker.send(body)
                    reply = self._decoder.decode(await worker.receive())
                if scope.cancelled_caught:
                    raise TemplateRenderError(f"The chat template took longer than {self.limits.timeout_s:g} s to "
                                              "render.", "timeout")
                reusable = reply.limit != "memory"  # after a MemoryError the worker exits
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                raise TemplateRenderError(
                    "The chat template renderer stopped while rendering these messages (it may have needed more "
                    f"than {self.limits.max_memory_mb} MiB).", "memory") from None
            finally:
                if reusable and worker in self._live:  # (not if aclose() stopped it meanwhile)
                    self._idle.append(worker)
                else:  # overran, died, or was cancelled mid-render: its state is unknown
                    self._live.discard(worker)
                    await worker.kill()
        if reply.limit == "memory":
            raise TemplateRenderError(f"The chat template needed more than {self.limits.max_memory_mb} MiB of "
                                      "memory to render.", "memory")
        if reply.limit == "output":
            raise TemplateRenderError(f"The rendered prompt exceeds {self.limits.max_output_chars} characters.",
                                      "output")
        if reply.error is not None or reply.text is None:
            raise TemplateRenderError(f"The chat template failed on these messages: {reply.error}")
        return reply.text

    async def warm(self) -> None:
        """Start one renderer now, so that the first render need not wait for its imports (about a second)."""
        if not self._live:
            self._idle.append(await self._start())

    async def aclose(self) -> None:
        """Stop every renderer process (a later render starts new ones)."""
        workers, self._idle = list(self._live), []
        self._live.clear()
        for w in workers:
            await w.kill()

    @contextlib.asynccontextmanager
    async def _slot(self, trusted: bool) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if not trusted:
                await stack.enter_async_context(self._request_slots)
            await stack.enter_async_context(self._slots)
            yield

    async def _start(self) -> _Worker:
        """Spawn a renderer; it becomes ready (`wait_ready`) once its imports are done."""
        lim = self.limits
        cmd = [sys.executable, "-m", "vx.serve.template_worker", "--timeout-s", str(lim.timeout_s),
               "--max-output-chars", str(lim.max_output_chars), "--max-memory-mb", str(lim.max_memory_mb)]
        # The worker imports vx from wherever this process did; one BLAS thread keeps its address space small.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            proc = await anyio.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env)
        except OSError as e:
            raise RendererUnavailable(f"The chat template renderer could not start: {e}") from e
        worker = _Worker(proc)
        self._live.add(worker)
        return worker
