"""A chat-template renderer process, and the messages it exchanges with the server (vx/serve/template_sandbox.py).

Run as `python -m vx.serve.template_worker --timeout-s T --max-output-chars N --max-memory-mb M`. It renders with
transformers' own renderer (`render_jinja_template`: jinja2's ImmutableSandboxedEnvironment, the same globals and
filters as `tokenizer.apply_chat_template`), so a template renders here exactly as it would in-process. The
sandbox stops templates from reaching Python's internals; this process bounds what they can cost: its address
space is capped (RLIMIT_AS, where the platform has it), an oversized result is refused before it is sent, and the
server kills it on a timeout. The frames on stdin/stdout are a 4-byte big-endian length and a msgpack body.
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

import msgspec

_HEADER = struct.Struct(">I")
READY = b"ready"  # the first frame: imports done, limits set


class RenderRequest(msgspec.Struct):
    """One render: what `apply_chat_template(..., tokenize=False)` receives."""

    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    variables: dict[str, Any] = {}  # the tokenizer's special tokens (bos_token, eos_token, ...)


class RenderReply(msgspec.Struct):
    """The rendered text, or why there is none: `error` (the template failed) or `limit` ("output" / "memory")."""

    text: str | None = None
    error: str | None = None
    limit: str | None = None


def write_frame(out: BinaryIO, body: bytes) -> None:
    """Send one length-prefixed frame."""
    out.write(_HEADER.pack(len(body)))
    out.write(body)
    out.flush()


def read_frame(inp: BinaryIO) -> bytes | None:
    """Read one length-prefixed frame; None at end of input (the server closed the pipe or exited)."""
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    body = inp.read(size)
    return body if len(body) == size else None


def render(req: RenderRequest, max_output_chars: int) -> RenderReply:
    """Render `req` as `tokenizer.apply_chat_template(tokenize=False)` would; errors come back as replies."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(conversations=[req.messages], tools=req.tools,
                                            chat_template=req.template,
                                            add_generation_prompt=req.add_generation_prompt, **req.variables)
    except MemoryError:
        return RenderReply(limit="memory")
    except Exception as e:  # jinja's own errors, SecurityError from the sandbox, raise_exception(...)
        return RenderReply(error=f"{type(e).__name__}: {e}"[:2000])
    text = rendered[0]
    if len(text) > max_output_chars:
        return RenderReply(limit="output")
    return RenderReply(text=text)


def _cap_address_space(max_memory_mb: int) -> None:
    """Let the process grow by `max_memory_mb` beyond what it maps now: past that, allocations raise MemoryError."""
    try:
        import resource

        import psutil
    except ImportError:  # no resource module (Windows): the timeout and the output cap still hold
        return
    limit = psutil.Process().memory_info().vms + max_memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and hard < limit:
        limit = hard
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a render that dies leaves no core file behind
    except (ValueError, OSError) as e:  # macOS refuses RLIMIT_AS
        print(f"vx template worker: no memory cap on this platform ({e})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Serve render requests on stdin/stdout until stdin closes."""
    parser = argparse.ArgumentParser(prog="python -m vx.serve.template_worker")
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--max-output-chars", type=int, required=True)
    parser.add_argument("--max-memory-mb", type=int, required=True)
    ns = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: the server stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The frames own fd 1; anything else that prints (a stray print, a library) goes to stderr instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    inp = sys.stdin.buffer
    import transformers.utils.chat_template_utils  # noqa: F401  (imported before the cap: it maps ~150 MB)

    _cap_address_space(ns.max_memory_mb)
    decoder, encoder = msgspec.msgpack.Decoder(RenderRequest), msgspec.msgpack.Encoder()
    write_frame(out, READY)
    while (body := read_frame(inp)) is not None:
        # If the server is gone mid-render, nobody kills this process on a timeout: SIGALRM's default action does.
        signal.setitimer(signal.ITIMER_REAL, 2 * ns.timeout_s + 5)
        reply = render(decoder.decode(body), ns.max_output_chars)
        signal.setitimer(signal.ITIMER_REAL, 0)
        write_frame(out, encoder.encode(reply))
        if reply.limit == "memory":
            return  # the heap may be fragmented or half-built: the server starts a fresh process


if __name__ == "__main__":
    main()
