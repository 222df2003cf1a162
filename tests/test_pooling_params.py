"""PoolingParams: validated at construction, Matryoshka `dimensions` only where a model's config allows them."""

from __future__ import annotations

import msgspec
import pytest

from vx.config.hf_config import HFConfig
from vx.pooling_params import PoolingParams, check_dimensions, matryoshka_dimensions


def test_defaults_are_last_token_normalised():
    params = PoolingParams()
    assert (params.pooling_type, params.normalize, params.dimensions) == ("last", True, None)
    assert not params.needs_all_tokens and PoolingParams(pooling_type="mean").needs_all_tokens


@pytest.mark.parametrize("fields, match", [
    ({"pooling_type": "cls"}, "pooling_type"), ({"normalize": 1}, "normalize"), ({"dimensions": 0}, "dimensions"),
    ({"dimensions": True}, "dimensions"), ({"dimensions": 2.0}, "dimensions"),
])
def test_bad_values_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**fields)
    with pytest.raises(ValueError, match=match):
        PoolingParams().clone(**fields)


def test_round_trips_msgpack():
    params = PoolingParams(pooling_type="mean", normalize=False, dimensions=32)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=PoolingParams) == params


def test_dimensions_follow_the_model_config():
    plain = HFConfig(hidden_size=64)
    listed = HFConfig(hidden_size=64, matryoshka_dimensions=[16, 32])
    any_size = HFConfig(hidden_size=64, is_matryoshka=True)
    assert matryoshka_dimensions(plain) is None and matryoshka_dimensions(listed) == [16, 32]
    assert matryoshka_dimensions(any_size) == []
    for config in (plain, listed, any_size):
        check_dimensions(PoolingParams(), config)  # no cut asked: always fine
    with pytest.raises(ValueError, match="no Matryoshka"):
        check_dimensions(PoolingParams(dimensions=16), plain)
    with pytest.raises(ValueError, match="no Matryoshka"):
        check_dimensions(PoolingParams(dimensions=16), None)
    check_dimensions(PoolingParams(dimensions=32), listed)
    with pytest.raises(ValueError, match=r"not one of the model's matryoshka_dimensions \[16, 32\]"):
        check_dimensions(PoolingParams(dimensions=24), listed)
    check_dimensions(PoolingParams(dimensions=24), any_size)
    with pytest.raises(ValueError, match="exceeds the model's embedding size"):
        check_dimensions(PoolingParams(dimensions=65), any_size)
