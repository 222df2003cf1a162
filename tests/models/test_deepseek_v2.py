"""DeepSeek-V2's parts against Hugging Face's: routing, the softmax scale under YaRN, which layers are sparse, and
what is refused. (Whole-model logits: tests/models/test_llama_vs_hf.py; the engine: tests/e2e.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.tiny_models import make_tiny_config
from vx.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MoE, mla_softmax_scale
from vx.models.layers.grouped_topk import deepseek_v2_route


@pytest.mark.parametrize("method,n_group,topk_group,top_k", [("greedy", None, None, 2),
                                                             ("group_limited_greedy", 4, 2, 3),
                                                             ("group_limited_greedy", 2, 1, 2)])
def test_routing_equals_hf_router(method, n_group, topk_group, top_k):
    """The same experts with the same weights as Hugging Face's DeepseekV2TopkRouter, scaled by
    routed_scaling_factor, for 64 random tokens."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = make_tiny_config("deepseek_v2", topk_method=method, n_group=n_group, topk_group=topk_group,
                              num_experts_per_tok=top_k, routed_scaling_factor=2.5)
    router = DeepseekV2TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    hidden = torch.randn(64, config.hidden_size)
    logits, want_w, want_ids = router(hidden)
    got_w, got_ids = deepseek_v2_route(logits, top_k, method, n_group, topk_group, 2.5)
    order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got_ids.gather(-1, order_got), want_ids.gather(-1, order_want))
    torch.testing.assert_close(got_w.gather(-1, order_got), want_w.gather(-1, order_want), rtol=0, atol=1e-7)
    if method == "group_limited_greedy" and topk_group == 1:
        plain = deepseek_v2_route(logits, top_k, "greedy", None, None, 2.5)[1]
        assert not torch.equal(plain.sort(-1).values, got_ids.sort(-1).values), "the group limit never bit"


def test_yarn_softmax_scale_equals_hf():
    """With YaRN and mscale_all_dim, MLA's softmax scale is qk_head_dim^-0.5 * mscale^2, as Hugging Face's."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    config = make_tiny_config("deepseek_v2_qlora_yarn")
    want = DeepseekV2Attention(config, 0).scaling
    assert mla_softmax_scale(config) == pytest.approx(want, rel=1e-12)
    assert want != pytest.approx((config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
    assert mla_softmax_scale(make_tiny_config("deepseek_v2")) == pytest.approx(32 ** -0.5)


def test_dense_and_sparse_layers():
    """first_k_dense_replace layers are dense; after them every moe_layer_freq-th layer is sparse (DeepSeek's rule;
    1, every layer, in the released V2 models and in Hugging Face's)."""
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(make_tiny_config("deepseek_v2", num_hidden_layers=4, moe_layer_freq=2))
    assert [isinstance(layer.mlp, DeepseekV2MoE) for layer in model.model.layers] == [False, False, True, False]
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(make_tiny_config("deepseek_v2", num_hidden_layers=4))
    assert [isinstance(layer.mlp, DeepseekV2MoE) for layer in model.model.layers] == [False, True, True, True]


@pytest.mark.parametrize("overrides,match", [
    (dict(norm_topk_prob=True), "norm_topk_prob"),
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    (dict(n_group=3), "n_group=3"),
    (dict(topk_group=5), "topk_group=5"),
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
])
def test_unsupported_configs_are_refused_by_name(overrides, match):
    with torch.device("meta"), pytest.raises(ValueError, match=match):
        DeepseekV2ForCausalLM(make_tiny_config("deepseek_v2", **overrides))


def test_quantized_checkpoints_are_refused():
    with torch.device("meta"), pytest.raises(ValueError, match="Quantized DeepSeek-V2"):
        DeepseekV2ForCausalLM(make_tiny_config("deepseek_v2"), quant_config=nn.Module())  # type: ignore[arg-type]
