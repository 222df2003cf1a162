"""Session-wide fixtures: tiny random models of each supported family, with a tokenizer, built once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before anything imports torch (the tiny models below do): OpenMP threads that spin while they wait stall as soon
# as another process wants a core, which on a shared 2-core machine made in-process generation ~10x slower. The suite
# runs many processes at once, so it keeps them sleeping at once (no GOMP_SPINCOUNT: vx's bounded spin stays off).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every engine the suite starts would otherwise compile its decode graph in the background (tens of seconds of CPU
# each): the compiled path has its own tests (tests/gpu/graphs/), which turn it back on.
os.environ.setdefault("VX_DECODE_COMPILE", "off")



def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """family -> directory with config.json, safetensors weights and a byte-level BPE tokenizer."""
    from tests.support.tiny_models import ENGINE_FAMILIES, make_tiny_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    dirs = {}
    for fam in ENGINE_FAMILIES:
        d = tmp_path_factory.mktemp(f"tiny-{fam}")
        make_tiny_model(fam, str(d), eos_token_id=0, bos_token_id=0, pad_token_id=0)
        make_tiny_tokenizer(str(d))
        dirs[fam] = str(d)
    return dirs


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs) -> str:
    """The default tiny model for tests that need just one (Qwen3 family)."""
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """`tiny_gguf(types, tied=False, family="llama", kv_b_form="kv_b")` -> TinyGGUF: a seeded tiny model of `family`
    (llama, gemma3, gemma2, phi3, qwen3_moe, mixtral, deepseek_v2 or deepseek_v2_qlora_yarn; tests.support.tiny_gguf)
    written as a GGUF file with its weights in `types` (a GGML type name, or "Q4_K_M" for
    tests.support.tiny_gguf.q4_k_m_like), and the same weights dequantized by gguf in a float directory; `kv_b_form`
    (DeepSeek-V2): "kv_b" or "split", as older or newer converters store MLA's up-projection. Built once per session
    per (types, tied, family, kv_b_form), sharing one tokenizer."""
    from gguf import GGMLQuantizationType

    from tests.support.tiny_gguf import q4_k_m_like, uniform, write_tiny_gguf
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tokenizer_dir = str(tmp_path_factory.mktemp("gguf-tokenizer"))
    make_tiny_tokenizer(tokenizer_dir)
    cache = {}

    def get(types: str, tied: bool = False, family: str = "llama", kv_b_form: str = "kv_b"):
        key = (types, tied, family, kv_b_form)
        if key not in cache:
            chooser = q4_k_m_like if types == "Q4_K_M" else uniform(GGMLQuantizationType[types])
            folder = tmp_path_factory.mktemp(f"gguf-{family}-{types}-{'tied' if tied else 'untied'}-{kv_b_form}")
            cache[key] = write_tiny_gguf(folder, chooser, tied=tied, tokenizer_dir=tokenizer_dir, family=family,
                                         kv_b_form=kv_b_form)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The bundled SmolLM2-135M-Instruct's config directory (config, tokenizer; its weights stay in the GGUF
    file), written once into the vx cache."""
    from vx.config.model_source import default_model_file, resolve_model

    try:
        default_model_file()
    except ValueError as e:
        pytest.fail(f"the default model must be installed for the tests: {e}")
    return resolve_model(None)
