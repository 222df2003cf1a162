"""Building vx's C kernels on first use (vx.kernels.build): the libraries a worker builds before its model loads are
the ones the kernels' loaders load, and a build that has to happen says so on the progress log, once."""

from __future__ import annotations

import logging

from vx.gpu.attention import cpu_kernels
from vx.kernels import gguf_matmul
from vx.kernels.build import Library, build_libraries, library_path, load_library
from vx.progress import LOGGER_NAME

_SOURCE = "int vx_answer(void) { return 42; }\n"


def _tiny_library(tmp_path, name: str) -> Library:
    source = tmp_path / f"{name}.c"
    source.write_text(_SOURCE)
    return Library(source, ("-O1", "-fPIC"), (), f"test library {name}")


def test_missing_libraries_are_built_with_a_progress_line_and_a_warm_cache_says_nothing(tmp_path, monkeypatch,
                                                                                          caplog):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    libraries = [_tiny_library(tmp_path, "one"), _tiny_library(tmp_path, "two")]
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        build_libraries(libraries)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert len(lines) == 2, lines
    assert "building vx's CPU kernels for this machine (first run only: 2 C libraries)" in lines[0]
    assert "CPU kernels built in" in lines[1] and "(2 of 2;" in lines[1]
    for lib in libraries:
        assert library_path(lib).exists()
        loaded = load_library(lib.source, lib.cflags, lib.libs, lib.what)  # the loader finds the build
        assert loaded.vx_answer() == 42
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        build_libraries(libraries)
    assert not [r for r in caplog.records if r.name == LOGGER_NAME]


def test_kernels_off_build_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VX_CPU_KERNELS", "0")
    lib = _tiny_library(tmp_path, "off")
    build_libraries([lib])
    assert not library_path(lib).exists()


def test_the_libraries_built_before_a_model_loads_are_those_its_kernels_load(monkeypatch):
    """Flags that drifted between a kernel's loader and its `Library` would build every library twice on a first
    start: once before the model loads, once more as it loads."""
    from vx.kernels import build, quant_matmul

    loaded = []

    def recording_load(source, cflags, libs, what):
        loaded.append(Library(source, tuple(cflags), tuple(libs), what))
        return build.load_library(source, cflags, libs, what)

    loaders = (gguf_matmul.load_gguf_matmul_kernel, quant_matmul.load_quant_matmul_kernel,
               cpu_kernels.load_paged_decode_kernel)
    for module in (gguf_matmul, quant_matmul, cpu_kernels):
        monkeypatch.setattr(module, "load_library", recording_load)
    for loader in loaders:
        loader.cache_clear()  # each loads its libraries again, through the recording loader
    try:
        for loader in loaders:
            loader()
    finally:
        for loader in loaders:
            loader.cache_clear()
    assert set(loaded) == {*gguf_matmul.default_libraries(), cpu_kernels.LIBRARY}
