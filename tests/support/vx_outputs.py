"""What vx computes for a model directory, for tests that compare two checkpoints of the same model: the loaded
model (resolved as the engine resolves it), its prefill logits, its greedy tokens through `vx.LLM`, and the bytes its
linear layers' weights take."""

from __future__ import annotations

import random
from typing import Any

import torch

import vx
from tests.support.paged_attention import PagedRunner
from vx.config import EngineArgs, checkpoint_quantization_config
from vx.gpu.attention import get_attn_backend
from vx.gpu.kv_cache import bind_kv_caches
from vx.models.layers.linear import LinearBase
from vx.models.layers.quantization import get_quantization_config
from vx.models.loader import DefaultModelLoader

BLOCK_SIZE = 4


def prompts(n: int = 8, vocab: int = 400, seed: int = 7) -> list[list[int]]:
    """`n` seeded prompts of token ids, 3 to 40 tokens long."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 41))] for _ in range(n)]


def load_vx(model_dir: str, dtype: torch.dtype = torch.float32, quantization: str | None = None) -> torch.nn.Module:
    """The vx model of `model_dir`, with the quantization the engine would resolve for it."""
    config = EngineArgs(model=model_dir, device="cpu", dtype=str(dtype).removeprefix("torch."),
                        quantization=quantization).create_config()
    hf_config = config.model_config.hf_config
    quant_config = get_quantization_config(config.quant_config.method, checkpoint_quantization_config(hf_config))
    return DefaultModelLoader().load_model(model_dir, hf_config, dtype, torch.device("cpu"), quant_config)


def prefill_logits(model: torch.nn.Module, token_lists: list[list[int]],
                   dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """float32 logits [len, vocab] of every prompt, all prefilled in one batch through the paged torch backend."""
    backend = get_attn_backend("torch", "cpu")
    num_blocks = sum(-(-len(tokens) // BLOCK_SIZE) for tokens in token_lists)
    bind_kv_caches(model, backend, num_blocks, BLOCK_SIZE, dtype, "cpu")
    runner = PagedRunner(model, backend, num_blocks, BLOCK_SIZE)
    for i, tokens in enumerate(token_lists):
        runner.add(str(i), tokens)
    out = runner.step({str(i): len(tokens) for i, tokens in enumerate(token_lists)})
    return [out[str(i)] for i in range(len(token_lists))]


def greedy_tokens(model_dir: str, token_lists: list[list[int]], max_tokens: int = 12,
                  **engine_args: Any) -> list[list[int]]:
    """Greedy completions of each prompt through `vx.LLM` (the whole engine, in-process)."""
    llm = vx.LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=200, block_size=16,
                 **engine_args)
    try:
        outs = llm.generate(token_lists, vx.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the linear layers' weights hold, packed or float (their biases aside)."""
    total = 0
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        packed = getattr(module, "quant_weight", None)
        if packed is not None:
            total += packed.nbytes
        total += sum(p.nbytes for name, p in module.named_parameters(recurse=False) if name != "bias")
    return total


def logits_difference(model_a: torch.nn.Module, model_b: torch.nn.Module,
                      token_lists: list[list[int]] | None = None) -> tuple[float, float]:
    """(largest absolute logits difference, largest |logit| of model_b) over the prompts' prefills."""
    token_lists = token_lists or prompts()
    a, b = prefill_logits(model_a, token_lists), prefill_logits(model_b, token_lists)
    return (max(float((x - y).abs().max()) for x, y in zip(a, b)), max(float(y.abs().max()) for y in b))
