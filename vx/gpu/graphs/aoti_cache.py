"""The cache of AOT-compiled CPU decode graphs: its keys and paths, and the child process that fills it.

Packages live under `$VX_CACHE_DIR/decode-graphs/KEY/`, KEY a digest of everything a package bakes in: shapes
(model, dtype, KV cache blocks and layout, blocks per sequence), the code (torch, vx's sources), the CPU and the
thread count; one package per padded size under a key (`sizeN.pt2`, its sidecar `sizeN.json` written last). A
missing package is compiled by `python -m vx.gpu.graphs.aoti_compile` (`run_compile_child`). Keys no engine used
for `UNUSED_KEY_DAYS` are removed when a package is compiled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import msgspec
import torch

from vx import envs
from vx.kv_spec import KVCacheGroupSpec
from vx.config import VxConfig, encode_config
from vx.gpu.graphs.capture import CompileCancelled

FORMAT = 1  # bump when the package's inputs or the sidecar change
CHILD_MODULE = "vx.gpu.graphs.aoti_compile"
CHILD_TIMEOUT_S = 1800.0  # far past any size's compile on 2 cores: a child that runs this long is stuck
# A key no engine has used for this long goes at the next compile (another vx, torch, model or cache size made
# it; a few MB a size): the cache must not grow with every upgrade. An engine that uses a key marks it used.
UNUSED_KEY_DAYS = 30.0


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model reaches from its modules, by a path: parameters and buffers by their names, plain
    tensors by `module:attr` then `.attr` / `[i]` / `[key]` through lists, dicts and vx's own objects (quantized
    weights live in kernel objects, KV caches are plain attributes). Deterministic for one model structure: the
    child names the package's constants by these paths, the engine finds its tensors by them."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            out.setdefault(path, obj)
            return
        if depth > 6 or id(obj) in seen or isinstance(obj, torch.nn.Module):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                visit(x, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                if isinstance(k, str):
                    visit(x, f"{path}[{k}]", depth + 1)
        elif type(obj).__module__.startswith("vx.") and hasattr(obj, "__dict__"):
            for k, x in vars(obj).items():
                visit(x, f"{path}.{k}", depth + 1)

    for module_path, module in model.named_modules(remove_duplicate=False):
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                visit(value, f"{module_path}:{name}", 0)
    return out


def describe(tensor: torch.Tensor) -> list:
    """What a package assumes of a constant: shape, strides, dtype (recorded by the child, checked at load)."""
    return [list(tensor.shape), list(tensor.stride()), str(tensor.dtype)]


def sidecar_path(package: str) -> str:
    """The JSON beside a package: its key and the constants it expects; written last, so it marks a whole package."""
    return package.removesuffix(".pt2") + ".json"


def read_sidecar(package: str, key: str, size: int) -> dict | None:
    """The sidecar of a whole package of this key and size, else None (missing, partial, or another key's)."""
    try:
        with open(sidecar_path(package)) as f:
            sidecar = json.load(f)
    except (OSError, ValueError):
        return None
    if sidecar.get("key") != key or sidecar.get("size") != size or not os.path.exists(package):
        return None
    return sidecar


# -- how long a compile takes --------------------------------------------------------------------------------------

# A compile child's seconds before any per-layer work (interpreter, torch, the model's load) and per decoder layer
# (export, inductor's code generation and the C++ compile of its output grow with the layers), on a machine that has
# compiled nothing yet: the estimate a first start gives. docs/decode_graphs.md has the measurement.
FIRST_COMPILE_BASE_S = 6.0
FIRST_COMPILE_S_PER_LAYER = 1.2


def estimate_compile_s(root: Path, layers: int) -> float:
    """About how long a compile child takes for a model of `layers` decoder layers: at the per-layer pace of the
    newest compile recorded under `root` (this machine's, any model), else the first-start figures above."""
    newest: tuple[float, float] | None = None  # (sidecar's time, seconds per layer)
    for sidecar in root.glob("*/size*.json"):
        try:
            record = json.loads(sidecar.read_text())
            pace = float(record["child_s"]) / int(record["layers"])
            mtime = sidecar.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue  # a sidecar of an older vx, or one being written
        if newest is None or mtime > newest[0]:
            newest = (mtime, pace)
    if newest is None:
        return FIRST_COMPILE_BASE_S + FIRST_COMPILE_S_PER_LAYER * layers
    return newest[1] * layers


# -- keys --------------------------------------------------------------------------------------------------------

@functools.cache
def _vx_sources_digest() -> str:
    """A digest of vx's Python and C sources: a package built by other code is never reused."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _model_files(model: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the model's file, or of its directory's files: a changed checkpoint changes the key."""
    p = Path(model)
    files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else []
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (the package's kernels use the ISA it was compiled for)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags") and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    return json.dumps([platform.machine(), torch.backends.cpu.get_cpu_capability(), fields], sort_keys=True)


def graph_config(config: VxConfig) -> dict[str, Any]:
    """The settings a package's code depends on. The HF config is not among them: it is read from the model files
    (in the key by name, size and time), and its in-memory form differs between an in-process engine (a
    transformers config) and an engine process (its resolved fields), which must share packages. Nor are the
    scheduler's limits (the padded size is the package's own), the seed or the structured-output settings."""
    mc, cc, dc = config.model_config, config.cache_config, config.device_config
    return {"model": mc.model, "architecture": mc.architecture, "dtype": mc.dtype,
            "max_model_len": mc.max_model_len, "vocab_size": mc.vocab_size, "block_size": cc.block_size,
            "kv_cache_dtype": cc.kv_cache_dtype, "device": dc.device, "attention_backend": dc.attention_backend,
            "quantization": config.quant_config.method}


def cache_key(config: VxConfig, num_blocks: int, groups: tuple[KVCacheGroupSpec, ...], max_blocks_per_seq: int,
              threads: int) -> str:
    """The digest of everything a package depends on, but the padded size (one package per size under a key)."""
    from vx.version import __version__

    parts = {
        "format": FORMAT, "config": graph_config(config),
        "model_files": _model_files(config.model_config.model), "num_blocks": num_blocks,
        "groups": msgspec.json.encode(groups).decode(), "max_blocks_per_seq": max_blocks_per_seq,
        "threads": threads, "env": [envs.VX_CPU_MATMUL.get(), envs.VX_CPU_KERNELS.get()],
        "torch": torch.__version__, "vx": __version__, "sources": _vx_sources_digest(),
        "python": sys.version, "cpu": _cpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# -- the compile child -------------------------------------------------------------------------------------------

class CompileChildren:
    """The compile child of one engine, one at a time, and the switch that kills it when the engine shuts down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self.cancelled = False

    def run(self, argv: list[str], log: Any) -> int | None:
        """Run `argv` to its end; its exit code, or None when it ran past `CHILD_TIMEOUT_S` (then killed)."""
        with self._lock:
            if self.cancelled:
                raise CompileCancelled("the engine shut down")
            self._child = child = subprocess.Popen(argv, env=_child_env(), stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT)
        try:
            return child.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return None
        finally:
            with self._lock:
                self._child = None

    def cancel(self) -> None:
        """Kill the running child, if any, and start no other (the engine shuts down or its interpreter exits)."""
        with self._lock:
            self.cancelled = True
            if self._child is not None:
                self._child.kill()


def run_compile_child(children: CompileChildren, config: VxConfig, request: dict[str, Any], directory: Path,
                      size: int) -> None:
    """Write `size`'s package (`request["package"]`, under `directory`) by a child; raises if the child fails or
    outlives `CHILD_TIMEOUT_S`. `request`: what the child needs besides the engine's config."""
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_files(directory)
    _remove_unused_keys(directory.parent, UNUSED_KEY_DAYS * 86400.0)
    with tempfile.TemporaryDirectory(dir=directory, prefix="tmp-request-") as tmp:
        config_path = os.path.join(tmp, "config.msgpack")
        with open(config_path, "wb") as f:
            f.write(encode_config(config))
        request_path = os.path.join(tmp, "request.json")
        with open(request_path, "w") as f:
            json.dump({"config": config_path, **request}, f)
        log_path = directory / f"size{size}.log"
        with open(log_path, "w") as log:
            rc = children.run([sys.executable, "-m", CHILD_MODULE, request_path], log)
        if rc is None:
            raise RuntimeError(f"the compile child ran past {CHILD_TIMEOUT_S:.0f} s (log: {log_path})")
        if rc != 0:
            raise RuntimeError(f"the compile child exited with {rc}: {_tail(log_path)} (log: {log_path})")


def _child_env() -> dict[str, str]:
    """The engine's environment, with vx importable as here and the child's own model runner making no graphs."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[envs.VX_DECODE_COMPILE.name] = "off"
    return env


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


# -- pruning -----------------------------------------------------------------------------------------------------

def _remove_stale_files(directory: Path) -> None:
    """Drop what a killed engine or child left in `directory` (request folders, half-written packages): whatever
    is older than any compile can run, so a compile still running for another engine keeps its files."""
    _remove_older_than(directory.glob("tmp*"), time.time() - 2 * CHILD_TIMEOUT_S)


def mark_used(directory: Path) -> None:
    """Mark a key's folder used now (an engine loaded from it), so that pruning keeps it."""
    try:
        os.utime(directory)
    except OSError:
        pass  # a read-only cache: its keys are never pruned by this engine either


def _remove_unused_keys(root: Path, unused_s: float) -> None:
    """Remove the key folders under `root` that no engine used or wrote in the last `unused_s` seconds."""
    _remove_older_than((path for path in root.iterdir() if path.is_dir()), time.time() - unused_s)


def _remove_older_than(paths: Iterable[Path], deadline: float) -> None:
    """Remove each of `paths` (a folder with what it holds) last modified before `deadline` (a `time.time()`)."""
    for path in paths:
        try:
            if path.stat().st_mtime < deadline:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError:
            pass  # another engine removed it first
