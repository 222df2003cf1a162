"""FusedMoE: routing, one matmul pair per active expert, the per-expert loader and its tensor-parallel slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vx.models.layers.fused_moe import FusedMoE

E, K, H, I = 6, 2, 16, 24


def _experts(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(I, H, generator=g), "w3": torch.randn(I, H, generator=g),
             "w2": torch.randn(H, I, generator=g)} for _ in range(E)]


class _RecordingGroup:
    """A stand-in tensor-parallel group of `world_size` ranks: its all-reduce records the partial sum it is given
    and returns it (the test adds the ranks' partials itself)."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size, self.rank_in_group = world_size, rank_in_group
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x.clone())
        return x


def _layer(experts, renormalize=True, tp_group=None) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, renormalize, prefix="layer.experts", tp_group=tp_group)
    for e, weights in enumerate(experts):
        for shard, w in weights.items():
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, w, shard, e)
    return layer


def _reference(x, logits, experts, renormalize):
    """Token by token: softmax, top-k, (renormalise), sum of the chosen experts' SwiGLU outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], -1)
        w, idx = torch.topk(probs, K)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w, idx.tolist()):
            ex = experts[e]
            out[t] += weight * (F.silu(x[t] @ ex["w1"].T) * (x[t] @ ex["w3"].T)) @ ex["w2"].T
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_equals_the_token_by_token_reference(renormalize):
    experts = _experts()
    x, logits = torch.randn(9, H), torch.randn(9, E)
    got = _layer(experts, renormalize)(x, logits)
    torch.testing.assert_close(got, _reference(x, logits, experts, renormalize), atol=1e-4, rtol=1e-5)


def test_each_active_expert_runs_once_on_all_its_tokens(monkeypatch):
    experts = _experts()
    x = torch.randn(12, H)
    logits = torch.full((12, E), -10.0)
    logits[:, 1] = logits[:, 4] = 5.0  # every token picks experts 1 and 4
    calls: list[int] = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda inp, w, *a: (calls.append(inp.shape[0]), real_linear(inp, w, *a))[1])
    _layer(experts)(x, logits)
    assert calls == [12, 12, 12, 12]  # (gate|up, down) for each of the two experts, all 12 tokens at once


def test_tensor_parallel_ranks_split_the_intermediate_dimension_and_sum_to_the_whole():
    experts = _experts(1)
    x, logits = torch.randn(7, H), torch.randn(7, E)
    whole = _layer(experts)(x, logits)
    groups = [_RecordingGroup(2, r) for r in range(2)]
    ranks = [_layer(experts, tp_group=group) for group in groups]
    assert ranks[0].w13_weight.shape == (E, I, H) and ranks[0].w2_weight.shape == (E, H, I // 2)
    torch.testing.assert_close(sum(layer(x, logits) for layer in ranks), whole, atol=1e-4, rtol=1e-5)
    assert [len(group.reduced) for group in groups] == [1, 1]  # one all-reduce per forward, after the top-k sum
    assert all(group.reduced[0].shape == (7, H) for group in groups)


def test_a_split_layer_without_a_group_refuses_to_return_a_partial_sum():
    layer = FusedMoE(E, K, H, I, True, tp_size=2, tp_rank=0, prefix="layer.experts")
    with pytest.raises(ValueError, match="without a tp_group"):
        layer(torch.randn(3, H), torch.randn(3, E))


def test_loader_refuses_what_does_not_fit():
    layer = FusedMoE(E, K, H, I, True)
    with pytest.raises(ValueError, match="expert 6"):
        layer.weight_loader(layer.w13_weight, torch.zeros(I, H), "w1", 6)
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.w13_weight, torch.zeros(I, H + 1), "w3", 0)
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(E, E + 1, H, I, True)


def test_only_the_triton_path_is_graph_safe():
    """The CPU loop reads per-expert counts on the host, so a MoE model declares no decode graphs there (on CUDA
    the Triton path has no host read: the gpu tests replay it from a CUDA graph)."""
    from tests.support.tiny_models import make_tiny_config

    from vx.models.moe import Qwen3MoeForCausalLM

    layer = FusedMoE(4, 2, 16, 8, renormalize=True)
    assert not layer.graph_safe()
    assert not Qwen3MoeForCausalLM(make_tiny_config("qwen3_moe")).supports_decode_graphs
