"""A Llama-family model cut into pipeline stages: each stage builds and loads only its layers (the embedding on the
first, the final norm and LM head on the last), quietly skipping the other stages' checkpoint tensors; a tied LM
head away from the embedding's stage loads its own copy of the table."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.support.tiny_models import make_tiny_model

from vx.distributed import GroupCoordinator, pp_layer_range
from vx.models.llama import PPMissingLayer
from vx.models.loader import DefaultModelLoader


def test_layer_ranges_split_evenly_and_cover_every_layer():
    assert [pp_layer_range(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [pp_layer_range(8, s, 4) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="each stage needs one"):
        pp_layer_range(2, 0, 3)


def _stage(model_dir: str, stage: int, stages: int = 2):
    from transformers import AutoConfig

    group = GroupCoordinator(list(range(stages)), stage, None)  # construction and loading need no process group
    return DefaultModelLoader().load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu",
                                           pp_group=group)


@pytest.mark.parametrize("family", ["llama", "llama3_tied"])
def test_each_stage_holds_only_its_layers(tmp_path, caplog, family):
    from transformers import AutoConfig

    model_dir = make_tiny_model(family, tmp_path)
    whole = DefaultModelLoader().load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    whole_params = dict(whole.named_parameters())
    num_layers = len(whole.model.layers)
    with caplog.at_level(logging.WARNING):
        stages = [_stage(model_dir, s) for s in range(2)]
    assert not [r for r in caplog.records if "Ignoring checkpoint tensor" in r.getMessage()]
    first, last = stages
    assert not isinstance(first.model.embed_tokens, PPMissingLayer) and isinstance(last.model.embed_tokens,
                                                                                     PPMissingLayer)
    assert isinstance(first.model.norm, PPMissingLayer) and not isinstance(last.model.norm, PPMissingLayer)
    held = [{name for name, _ in stage.named_parameters()} for stage in stages]
    for s, stage in enumerate(stages):
        start, end = pp_layer_range(num_layers, s, 2)
        layers = {int(name.split(".")[2]) for name in held[s] if name.startswith("model.layers.")}
        assert layers == set(range(start, end))
        for name, param in stage.named_parameters():  # every tensor held is the whole model's, loaded
            want = whole_params.get(name, whole_params["model.embed_tokens.weight"] if name == "lm_head.weight"
                                    else None)
            torch.testing.assert_close(param, want, atol=0, rtol=0)
    assert "lm_head.weight" in held[1] and not any(name.startswith("lm_head") for name in held[0])
    # Together the stages hold every layer once (the tied table twice: the embedding's stage and the head's).
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in whole.parameters()) + (
        whole.model.embed_tokens.weight.numel() if family == "llama3_tied" else 0)
