"""DeepSeek-V2's expert routing: softmax scores, top-k over all experts or within the best groups, scaled.

`group_limited_greedy` (DeepSeek-V2's device-limited routing) splits the experts into `n_group` equal groups, ranks
each group by its best expert's score, keeps the `topk_group` best groups and takes the top k experts among theirs;
`greedy` takes the top k of all. The chosen scores are multiplied by `routed_scaling_factor` and not renormalised, as
Hugging Face's DeepseekV2 router computes them.
"""

from __future__ import annotations

import torch

TOPK_METHODS = ("greedy", "group_limited_greedy")


def check_routing(num_experts: int, top_k: int, topk_method: str, n_group: int | None,
                  topk_group: int | None) -> None:
    """Refuse, naming the field, a routing this module does not compute."""
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method={topk_method!r} is not supported for DeepSeek-V2 routing; supported: "
                         f"{', '.join(TOPK_METHODS)}.")
    if topk_method == "group_limited_greedy":
        if not n_group or num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide n_routed_experts={num_experts}.")
        if not topk_group or not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}.")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups.")


def deepseek_v2_route(router_logits: torch.Tensor, top_k: int, topk_method: str, n_group: int | None,
                      topk_group: int | None, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E]."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    if topk_method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        grouped = scores.view(num_tokens, n_group, num_experts // n_group)
        best_groups = torch.topk(grouped.max(dim=-1).values, k=topk_group, dim=-1).indices
        keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best_groups, True)
        # Experts outside the kept groups score 0 (as Hugging Face masks them): never above a kept expert's.
        scores = grouped.masked_fill(~keep[:, :, None], 0.0).view(num_tokens, num_experts)
    weights, experts = torch.topk(scores, k=top_k, dim=-1)
    return weights * routed_scaling_factor, experts
