"""llama.cpp's own programs, run beside vx: `llama-bench` for batch-1 decode and prefill, `llama-server` for
concurrent requests (continuous batching over `-np N` slots) and for its process's memory.

The programs come from a llama.cpp build folder (docs/performance.md says how to build one): `--llama-cpp-bin`, else
`$VX_BENCH_LLAMA_CPP_BIN`, else `EXAMPLE_BIN_DIR`. Used by `benchmarks.vs_llama_cpp`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from typing import Any

BIN_ENV = "VX_BENCH_LLAMA_CPP_BIN"
# Where this project's machines keep a build (NOTES: llama.cpp's sources from the llama-cpp-python sdist).
EXAMPLE_BIN_DIR = "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
TOOLS = ("llama-bench", "llama-server")


def bin_dir(given: str | None) -> str:
    """The build folder to use: `given`, else $VX_BENCH_LLAMA_CPP_BIN, else EXAMPLE_BIN_DIR."""
    return os.path.abspath(os.path.expanduser(given or os.environ.get(BIN_ENV) or EXAMPLE_BIN_DIR))


def missing(folder: str) -> str | None:
    """Why llama.cpp cannot run from `folder` ("not built: ..."), or None when its programs are there."""
    absent = [t for t in TOOLS if not os.access(os.path.join(folder, t), os.X_OK)]
    if absent:
        return f"not built: no {' or '.join(absent)} in {folder} (docs/performance.md: building llama.cpp)"
    return None


def llama_bench(folder: str, gguf: str, threads: int, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    """One `llama-bench` run of a `prompt_tokens` prefill and a `gen_tokens` decode from an empty context (each
    after its own warm-up run): {"prefill_s", "prefill_tok_s", "decode_tok_s"}."""
    cmd = [os.path.join(folder, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(prompt_tokens),
           "-n", str(gen_tokens), "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"llama-bench exited with {proc.returncode}: {tail}")
    out: dict[str, float] = {}
    for test in json.loads(proc.stdout):
        if test["n_gen"] == 0:
            out["prefill_s"] = test["avg_ns"] / 1e9
            out["prefill_tok_s"] = test["avg_ts"]
        else:
            out["decode_tok_s"] = test["avg_ts"]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` on a GGUF file with `slots` parallel slots sharing a `context`-token KV cache, on a free local
    port; `with LlamaServer(...) as server:` starts it and waits until /health answers."""

    def __init__(self, folder: str, gguf: str, threads: int, slots: int, context: int,
                 start_timeout_s: float = 600.0) -> None:
        self.cmd = [os.path.join(folder, "llama-server"), "-m", gguf, "-t", str(threads), "-tb", str(threads),
                    "-np", str(slots), "-c", str(context), "--host", "127.0.0.1", "--port", str(_free_port()),
                    "--no-webui"]
        self.url = f"http://127.0.0.1:{self.cmd[self.cmd.index('--port') + 1]}"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def describe(self) -> str:
        """Its command line, without the file and the address."""
        return "llama-server " + " ".join(self.cmd[3:self.cmd.index("--host")])

    def __enter__(self) -> "LlamaServer":
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server did not answer /health in {self.start_timeout_s:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        self._log.seek(0)
        return " / ".join(self._log.read().decode(errors="replace").strip().splitlines()[-3:])

    def rss_bytes(self) -> int:
        """The server process's resident memory."""
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    async def complete(self, client: Any, prompt: list[int], new_tokens: int) -> int:
        """One greedy /completion of exactly `new_tokens` tokens (EOS ignored, no prompt cache) after the token ids
        `prompt`; the number of tokens it predicted."""
        body = {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
                "cache_prompt": False}
        response = await client.post(f"{self.url}/completion", json=body)
        response.raise_for_status()
        return int(response.json()["tokens_predicted"])

    async def complete_all(self, prompts: list[list[int]], new_tokens: int) -> float:
        """All `prompts` sent at once, `new_tokens` each; seconds from the first send to the last answer."""
        import anyio
        import httpx

        got: list[int] = []
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            async def one(prompt: list[int]) -> None:
                got.append(await self.complete(client, prompt, new_tokens))

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(one, p)
            seconds = time.perf_counter() - t0
        if got != [new_tokens] * len(prompts):
            raise RuntimeError(f"llama-server predicted {sorted(set(got))} tokens, not {new_tokens} each")
        return seconds

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
