"""A Llama-family or mixture-of-experts model split over two tensor-parallel ranks (gloo) gives the logits of the
whole model, and each rank holds about half of its sharded layers' parameters (the experts' included)."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_attention import PagedRunner
from tests.support.two_ranks import run_on_two_ranks

PROMPTS = {"a": [5, 9, 13, 2, 7, 30, 31], "b": list(range(40, 73)), "c": [3]}
SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")
# Max |logit| here is ~9. A mixture-of-experts layer sums in one more order than a dense MLP does (each rank its
# experts' partials, then the ranks; the whole model expert by expert), which on these peaked tiny models costs a
# few more float32 ulps (TP=2 vs TP=1 max difference measured: llama 8.0e-6, qwen3 4.8e-6, mixtral 9.3e-6,
# qwen3_moe 1.5e-5).
LOGITS_ATOL = {"qwen3_moe": 2e-5, "mixtral": 2e-5}


def _logits(model) -> dict[str, list[list[float]]]:
    from vx.gpu.attention import get_attn_backend
    from vx.gpu.kv_cache import bind_kv_caches

    backend = get_attn_backend("torch", "cpu")
    bind_kv_caches(model, backend, 64, 4, torch.float32, "cpu")
    runner = PagedRunner(model, backend, 64, 4)
    for req_id, tokens in PROMPTS.items():
        runner.add(req_id, tokens)
    out = runner.step({req_id: len(tokens) for req_id, tokens in PROMPTS.items()})
    return {req_id: logits.tolist() for req_id, logits in out.items()}


def _sharded_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if any(f"{part}." in name for part in SHARDED))


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)


def _rank_job(model_dir: str, tp_group) -> dict:
    from transformers import AutoConfig

    from vx.models.loader import DefaultModelLoader

    config = AutoConfig.from_pretrained(model_dir)
    model = DefaultModelLoader().load_model(model_dir, config, torch.float32, "cpu", tp_group=tp_group)
    return {"logits": _logits(model), "sharded_bytes": _sharded_bytes(model), "expert_bytes": _expert_bytes(model)}


FAMILIES = ["llama", "qwen3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dirs, tmp_path_factory) -> tuple[dict[str, list[dict]], str | None]:
    """What each of two ranks, started once for all of them, found for every family (logits, bytes held)."""
    return run_on_two_ranks(_rank_job, {family: tiny_model_dirs[family] for family in FAMILIES},
                            tmp_path_factory.mktemp("tp-ranks"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_give_the_whole_model_logits(tiny_model_dirs, two_ranks, family):
    from transformers import AutoConfig

    from vx.models.loader import DefaultModelLoader

    model_dir = tiny_model_dirs[family]
    whole = DefaultModelLoader().load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    want = _logits(whole)
    results, error = two_ranks
    if family not in results:
        pytest.fail(f"the ranks stopped before {family} was done: {error}")
    for got in results[family]:
        for req_id, logits in want.items():
            torch.testing.assert_close(torch.tensor(got["logits"][req_id]), torch.tensor(logits),
                                       atol=LOGITS_ATOL.get(family, 1e-5), rtol=0)
        # Each rank holds half of every sharded layer (KV heads: 2 over 2 ranks, one each).
        assert got["sharded_bytes"] == pytest.approx(_sharded_bytes(whole) / 2, rel=0.01)
        # Each expert's intermediate features split in two; the router stays whole on both ranks.
        assert got["expert_bytes"] == _expert_bytes(whole) / 2
