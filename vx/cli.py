"""The `vx` command: `vx chat`, `vx generate "prompt"`, `vx serve`, `vx bench`, with the engine args as flags."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import typing
from typing import Any

from vx import envs
from vx.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (`--max-model-len`, `--no-enable-prefix-caching`, ...)."""
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        if f.name == "model":
            group.add_argument(flag, default=None,
                               help="HF model directory, .gguf file or Hugging Face id (Qwen/Qwen3-0.6B; "
                                    "default: the bundled SmolLM2-135M-Instruct)")
        elif "bool" in hint:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif "int" in hint:
            group.add_argument(flag, type=int, default=f.default)
        elif "float" in hint:
            group.add_argument(flag, type=float, default=f.default)
        else:
            group.add_argument(flag, default=f.default)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine args the user set (defaults left out so EngineArgs keeps its own)."""
    out = {}
    for f in dataclasses.fields(EngineArgs):
        v = getattr(ns, f.name)
        if v != f.default:
            out[f.name] = v
    return out


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.95)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params(ns: argparse.Namespace):
    from vx.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.sampling_seed)


async def _generate(ns: argparse.Namespace) -> None:
    from vx.client.async_llm import AsyncLLM

    kwargs = engine_kwargs(ns)
    model = kwargs.pop("model", None)
    async with AsyncLLM(model, **kwargs) as llm:
        async for delta in llm.stream(ns.prompt, sampling_params(ns)):
            print(delta, end="", flush=True)
        print()


async def _chat(ns: argparse.Namespace) -> None:
    import anyio

    from vx.client.async_llm import AsyncLLM

    kwargs = engine_kwargs(ns)
    model = kwargs.pop("model", None)
    params = sampling_params(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    reply_scope: list[anyio.CancelScope] = []  # the reply in progress, if any

    async with AsyncLLM(model, **kwargs) as llm, anyio.create_task_group() as tg:
        async def watch_sigint() -> None:
            # Ctrl-C stops the reply in progress; at the prompt it ends the session.
            with anyio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    if reply_scope:
                        reply_scope[0].cancel()
                    else:
                        tg.cancel_scope.cancel()
                        return

        tg.start_soon(watch_sigint)
        print("vx chat: type a message; Ctrl-C stops a reply, Ctrl-D (or Ctrl-C at the prompt) quits.",
              file=sys.stderr)
        while True:
            line = await anyio.to_thread.run_sync(_read_line, abandon_on_cancel=True)
            if line is None:
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply: list[str] = []
            with anyio.CancelScope() as scope:
                reply_scope.append(scope)
                async for delta in llm.chat(history, params):
                    reply.append(delta)
                    print(delta, end="", flush=True)
            reply_scope.clear()
            print(" [stopped]" if scope.cancelled_caught else "")
            history.append({"role": "assistant", "content": "".join(reply)})
        tg.cancel_scope.cancel()
    print(file=sys.stderr)


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None
    except KeyboardInterrupt:
        return None


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerOptions field (`--max-body-bytes`, `--keep-alive-on-engine-death`, ...)."""
    from vx.serve.options import ServerOptions

    group = parser.add_argument_group("server limits and behaviour")
    for f in dataclasses.fields(ServerOptions):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + " (default: %(default)s)"
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif "choices" in f.metadata:
            group.add_argument(flag, choices=f.metadata["choices"], default=f.default, help=help_text)
        else:
            group.add_argument(flag, type=int if f.type == "int" else float, default=f.default, help=help_text)


def server_options(ns: argparse.Namespace):
    """The ServerOptions the flags give."""
    from vx.serve.options import ServerOptions

    return ServerOptions(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerOptions)})


def _api_key(ns: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $VX_API_KEY; None for no key."""
    if ns.api_key and ns.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both.")
    if ns.api_key:
        logging.getLogger("vx.serve").warning(
            "vx serve: --api-key is visible to every user in the process list; prefer --api-key-file or $VX_API_KEY")
        return ns.api_key
    if ns.api_key_file:
        try:
            with open(ns.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {ns.api_key_file} holds no key.")
        return key
    return envs.VX_API_KEY.get() or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _serve(ns: argparse.Namespace) -> None:
    """Run the OpenAI-compatible server until SIGTERM / Ctrl-C (exit 0) or the engine's death (exit 1)."""
    from vx.optional_dependencies import MissingExtraError, needs_extra

    try:
        with needs_extra("vx serve", "serve"):
            from vx.serve.app import build_app
            from vx.serve.template_sandbox import TemplateLimits
            from vx.serve.server import run
    except MissingExtraError as e:
        raise SystemExit(str(e)) from None
    from vx.client.async_llm import AsyncLLM

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    vx_logger = logging.getLogger("vx")
    vx_logger.addHandler(handler)
    vx_logger.setLevel(ns.log_level.upper())
    kwargs = engine_kwargs(ns)
    model = kwargs.pop("model", None)
    llm = AsyncLLM(model, **kwargs)  # checks the engine args now, before the server binds its port
    options = server_options(ns)
    api_key = _api_key(ns)
    if not _is_loopback(ns.host):
        vx_logger.warning("vx serve: listening on %s, beyond loopback: whoever reaches it can use the model%s",
                          ns.host, "" if api_key else ", and no API key is set (--api-key-file, $VX_API_KEY)")
    chat_template = ns.chat_template
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    limits = TemplateLimits(timeout_s=ns.chat_template_timeout, max_output_chars=ns.chat_template_max_output_chars,
                            max_memory_mb=ns.chat_template_max_memory_mb, workers=ns.chat_template_workers)
    app = build_app(llm, served_model_names=ns.served_model_name, api_key=api_key, chat_template=chat_template,
                    options=options, trust_request_chat_template=ns.trust_request_chat_template,
                    chat_template_limits=limits, freeze_heap=True)
    code = run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    if code:
        raise SystemExit(code)


def _bench(ns: argparse.Namespace, rest: list[str]) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench_dir = os.path.join(root, "benchmarks")
    if not os.path.isdir(bench_dir):
        raise SystemExit("vx bench runs the benchmarks of a source checkout; benchmarks/ was not found "
                         f"next to {root}.")
    sys.path.insert(0, root)

    from benchmarks import BENCHMARKS, get_main

    name = ns.name or "run_all"
    if name in ("help", "-h", "--help"):
        print("vx bench [NAME] [ARGS...]: NAME is one of\n" +
              "\n".join(f"  {n:16s} {what}" for n, what in BENCHMARKS.items()) +
              "\n`vx bench NAME --help` shows a benchmark's own options.")
        return
    if name not in BENCHMARKS:
        raise SystemExit(f"No benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    get_main(name)(rest)


def add_chat_template_args(parser: argparse.ArgumentParser) -> None:
    """`vx serve`'s chat-template flags: whether requests may bring their own, and what rendering one may cost."""
    from vx.serve.template_sandbox import TemplateLimits  # no server dependencies: a dataclass

    d = TemplateLimits()
    group = parser.add_argument_group("chat templates (every template renders in a sandboxed renderer process)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a `chat_template` in chat requests (default: refused with a 400)")
    group.add_argument("--chat-template-timeout", type=float, default=d.timeout_s, metavar="SECONDS",
                       help=f"wall-clock limit of one render (default: {d.timeout_s:g})")
    group.add_argument("--chat-template-max-output-chars", type=int, default=d.max_output_chars, metavar="N",
                       help=f"longest rendered prompt (default: {d.max_output_chars})")
    group.add_argument("--chat-template-max-memory-mb", type=int, default=d.max_memory_mb, metavar="MB",
                       help=f"memory a render may allocate, where RLIMIT_AS exists (default: {d.max_memory_mb})")
    group.add_argument("--chat-template-workers", type=int, default=d.workers, metavar="N",
                       help=f"renderer processes at most (default: {d.workers})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vx", description="vx: embeddable LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="stream a completion of one prompt")
    p.add_argument("prompt")
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p = sub.add_parser("chat", help="interactive chat with streaming replies")
    p.add_argument("--system", default=None, help="a system message")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $VX_API_KEY, else no key); "
                        "visible in the process list: prefer --api-key-file or $VX_API_KEY")
    p.add_argument("--api-key-file", default=None, help="a file whose first line is the API key")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the --model argument)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    add_chat_template_args(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_server_options(p)
    add_engine_args(p)
    # No -h of its own: `vx bench NAME --help` reaches the benchmark's parser (`vx bench help` lists them).
    p = sub.add_parser("bench", help="run the benchmarks (vx beside its competitors)", add_help=False)
    p.add_argument("name", nargs="?", default=None,
                   help="one benchmark (default: all, quick sizes); 'help' lists them")
    return parser


def main(argv: list[str] | None = None) -> None:
    import anyio

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if ns.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if ns.command == "generate":
            anyio.run(_generate, ns)
        elif ns.command == "chat":
            anyio.run(_chat, ns)
        elif ns.command == "serve":
            _serve(ns)
        else:
            _bench(ns, rest)
    except ValueError as e:
        raise SystemExit(f"vx: error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
