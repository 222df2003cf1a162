"""CPU decode graphs compiled ahead of time by AOTInductor in a child process, loaded without the compiler.

`InductorGraphs` compiles in the engine: that imports torch._dynamo and torch._inductor, resident for the engine's
life (their memory: docs/decode_graphs.md). `AotiGraphs` instead takes each size's package from the cache (`vx.gpu.graphs.aoti_cache`),
compiled by a child that rebuilds the model from the engine's config, exports the decode forward at that size and
compiles it into a package holding code only. The engine loads it with `torch._C._aoti` (part of torch's core
library) and hands it its own weights and KV caches by reference (user-managed constants: no copy, the package
writes the engine's cache); its outputs are torch.compile's (docs/decode_graphs.md).

Loading hands over tensors unchecked, so a package is also refused when a constant it wants is not the engine's
tensor of that name, shape, strides and dtype. Should anything fail (child, load, check), this engine falls back to
`InductorGraphs` with a warning.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from vx import envs, progress
from vx.kv_spec import KVCacheGroupSpec
from vx.config import VxConfig
from vx.gpu.graphs.aoti_cache import (CompileChildren, cache_key, describe, estimate_compile_s, mark_used,
                                      named_tensors, read_sidecar, run_compile_child)
from vx.gpu.kv_cache import attention_layers
from vx.gpu.graphs.capture import CompileCancelled, GraphCapture

logger = logging.getLogger(__name__)


class AotiGraphs:
    """`GraphCapture` of the CPU: a size's graph is an AOTInductor package, from the cache or compiled by a child."""

    def __init__(self, model: torch.nn.Module, config: VxConfig, num_blocks: int,
                 groups: tuple[KVCacheGroupSpec, ...], max_blocks_per_seq: int,
                 fallback: Callable[[], GraphCapture], cache_dir: str | None = None) -> None:
        """`fallback`: makes the capture this engine uses instead once anything fails (`InductorGraphs`)."""
        self._model = model
        self._config = config
        self._num_blocks = num_blocks
        self._groups = groups
        self._max_blocks = max_blocks_per_seq
        self._threads = torch.get_num_threads()
        self.key = cache_key(config, num_blocks, groups, max_blocks_per_seq, self._threads)
        self.directory = Path(cache_dir or envs.VX_CACHE_DIR.get()) / "decode-graphs" / self.key
        self._make_fallback = fallback
        self._fallback: GraphCapture | None = None
        self._graphs: dict[int, tuple[Any, list[torch.Tensor]]] = {}  # size -> (loader, its inputs)
        self._children = CompileChildren()
        # A bound method of the small object only: a finalizer may hold it without holding the model alive.
        self.cancel = self._children.cancel
        self.children_run = 0  # how many packages this engine had compiled (the rest came from the cache)

    def build(self, size: int, args: tuple[Any, ...]) -> None:
        if self._fallback is None:
            try:
                self._graphs[size] = (self._load(size, compile_if_missing=True), _inputs(args))
                return
            except Exception as e:  # noqa: BLE001 - anything: this engine compiles in-process instead
                if self._children.cancelled:  # the engine shuts down: whatever broke, nothing failed
                    raise CompileCancelled(f"the engine shut down while batch size {size} was built ({e})") from e
                logger.warning("vx: the AOT-compiled decode graph of batch size %d is unavailable (%s: %s); this "
                               "engine compiles its decode graphs in-process instead", size, type(e).__name__, e)
                self._fallback = self._make_fallback()
        self._fallback.build(size, args)

    def run(self, size: int, args: tuple[Any, ...]) -> torch.Tensor:
        graph = self._graphs.get(size)
        if graph is None:
            return self._fallback.run(size, args)
        loader, inputs = graph
        return loader.run(inputs)[0]

    @property
    def using_fallback(self) -> bool:
        return self._fallback is not None

    def package_path(self, size: int) -> str:
        return str(self.directory / f"size{size}.pt2")

    def _load(self, size: int, compile_if_missing: bool) -> Any:
        """The loader of `size`'s package with the engine's tensors bound: from the cache, else compiled first."""
        package = self.package_path(size)
        sidecar = read_sidecar(package, self.key, size)
        started = None  # when this engine began compiling it (None: from the cache)
        if sidecar is None:
            if not compile_if_missing:
                raise RuntimeError(f"no package for batch size {size} under {self.directory}")
            started = time.perf_counter()
            self._compile(size)
            sidecar = read_sidecar(package, self.key, size)
            if sidecar is None:
                raise RuntimeError(f"the compile child wrote no valid package for batch size {size}")
        # The operators the package calls must exist before it loads (the proxy executor resolves their schemas).
        from vx.gpu.attention.cpu_kernels import register_paged_decode_op
        from vx.kernels import torch_ops

        torch_ops.library()
        register_paged_decode_op()
        loader = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
        tensors = named_tensors(self._model)
        expected = sidecar["constants"]  # package name -> [path, description]
        constants = {}
        for fqn in loader.get_constant_fqns():
            path, description = expected.get(fqn, (None, None))
            tensor = tensors.get(path)
            if tensor is None:
                raise RuntimeError(f"the package wants constant {fqn!r} ({path}), which this model does not have")
            if describe(tensor) != description:
                raise RuntimeError(f"constant {path!r} is {describe(tensor)} here, {description} in the package")
            constants[fqn] = tensor
        # (constants, use_inactive, check_full_update, user_managed): the engine's tensors by reference.
        loader.load_constants(constants, False, True, True)
        mark_used(self.directory)
        if started is not None:
            progress.logger.info("vx: the decode graph for batch size %d is ready (compiled in %.0f s, cached for "
                                 "later starts)", size, time.perf_counter() - started)
        return loader

    def _compile(self, size: int) -> None:
        """Run the child that writes `size`'s package; raises if it fails."""
        request = {"num_blocks": self._num_blocks, "size": size,
                   "groups": msgspec.json.encode(self._groups).decode(), "max_blocks_per_seq": self._max_blocks,
                   "threads": self._threads, "key": self.key, "package": self.package_path(size)}
        self.children_run += 1
        layers = len(attention_layers(self._model))
        progress.logger.info("vx: compiling the decode graph for batch size %d of this model (first run only, ~%.0f "
                             "s); decode steps run eagerly, slower, until it is ready", size,
                             estimate_compile_s(self.directory.parent, layers))
        run_compile_child(self._children, self._config, request, self.directory, size)


def _inputs(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The package's inputs from the decode graphs' arguments (views of their persistent buffers, so the list is
    built once per size): ids, positions, seq lens, then each group's slot mapping and block table."""
    _, input_ids, positions, metadata = args
    per_group = metadata if isinstance(metadata, list) else [metadata]
    return [input_ids, positions, per_group[0].seq_lens,
            *[t for md in per_group for t in (md.slot_mapping, md.block_table)]]
