"""The architecture registry (vx.models.registry): every row names a class that imports, the rows agree with each
other, and no other vx module spells an architecture's name, so a family is added by its file and one row."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from vx.models.registry import (ARCHITECTURES, architecture_of, gguf_architecture, model_architecture,
                                parallel_architectures, resolve_model_class, supported_architectures,
                                unsupported_architecture)

VX = Path(__file__).resolve().parents[2] / "vx"
REGISTRY = VX / "models" / "registry.py"

# String literals that equal an architecture's name but name something else.
NOT_ARCHITECTURES = {
    ("serve/reasoning.py", "qwen3"): "the reasoning parser's name (vLLM's --reasoning-parser qwen3)",
}


@pytest.mark.parametrize("name", supported_architectures())
def test_every_registered_name_imports_its_class(name):
    cls = resolve_model_class(name)
    assert isinstance(cls, type) and issubclass(cls, nn.Module)


def test_the_rows_are_consistent():
    names = [a.name for a in ARCHITECTURES]
    gguf_names = [a.gguf.name for a in ARCHITECTURES if a.gguf is not None]
    model_types = [a.model_type for a in ARCHITECTURES]
    assert len(set(names)) == len(names), names
    assert len(set(gguf_names)) == len(gguf_names), gguf_names
    assert len(set(model_types)) == len(model_types), model_types
    for row in ARCHITECTURES:
        module, _, cls = row.model_class.partition(":")
        assert module.startswith("vx.models.") and cls, row.model_class
        assert model_architecture(row.name) is row
        assert architecture_of(type("Config", (), {"model_type": row.model_type})()) is row
        if row.gguf is not None:
            assert gguf_architecture(row.gguf.name) is row.gguf
            for path in (row.gguf.config_fields, row.gguf.whole_config):
                if path is not None:  # a quirk's function exists where the row says
                    module, _, function = path.partition(":")
                    assert callable(getattr(importlib.import_module(module), function)), path


def test_unknown_names_are_refused_naming_the_supported_ones():
    assert unsupported_architecture("LlamaForCausalLM") is None
    reason = unsupported_architecture("GPT2LMHeadModel")
    assert "'GPT2LMHeadModel' is not supported" in reason and ", ".join(supported_architectures()) in reason
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_architecture("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported; supported: llama, "):
        gguf_architecture("falcon")
    assert architecture_of(object()) is None
    assert set(parallel_architectures()) <= set(supported_architectures())


def test_the_registry_imports_nothing_heavy():
    """The application process reads it (the config refuses unknown architectures there) and never imports torch."""
    code = "import sys, vx.models.registry; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_no_module_but_the_registry_names_an_architecture():
    """A family's quirks are read from its row, never keyed on its name elsewhere: every string literal in vx's
    sources is checked against the Hugging Face and GGUF names (and model types) the rows hold."""
    registered = {a.name for a in ARCHITECTURES} | {a.model_type for a in ARCHITECTURES} | {
        a.gguf.name for a in ARCHITECTURES if a.gguf is not None}
    found = []
    for path in sorted(VX.rglob("*.py")):
        if path == REGISTRY:
            continue
        rel = path.relative_to(VX).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in registered and (rel, node.value) not in \
                    NOT_ARCHITECTURES:
                found.append(f"vx/{rel}:{node.lineno} {node.value!r}")
    assert not found, "architecture names outside vx/models/registry.py (make them row fields): " + "; ".join(found)
