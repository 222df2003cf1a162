"""The KV cache's size: the CPU default from need under a cap, the user's arguments first, and the reason given."""

from __future__ import annotations

import pytest

from vx.cache.kv_cache_size import CPU_SEQUENCE_TOKENS, cpu_kv_cap_bytes, size_kv_cache
from vx.kv_spec import KVCacheSize

GiB = 2**30
BS = 16
PER_TOKEN = 46080  # the default model in float32: 2 (K, V) x 30 layers x 3 kv heads x 64 x 4 bytes
PER_BLOCK = PER_TOKEN * BS


def cpu(**kw) -> KVCacheSize:
    args = dict(device="cpu", block_size=BS, bytes_per_block=PER_BLOCK, max_model_len=8192, max_num_seqs=64,
                device_budget_bytes=4 * GiB)
    return size_kv_cache(**{**args, **kw})


def test_the_default_models_cpu_cache_comes_from_need():
    size = cpu()
    assert size.source == "need"
    assert size.num_blocks == 64 * CPU_SEQUENCE_TOKENS // BS + 1  # 64 sequences of 512 tokens + the null block
    assert size.num_blocks - 1 >= 8192 // BS  # one max_model_len sequence
    assert size.num_bytes <= 4 * GiB
    assert size.num_tokens == 64 * CPU_SEQUENCE_TOKENS
    assert size.num_bytes == size.num_blocks * PER_BLOCK  # 1,441 MiB, not the 4 GiB cap


def test_the_default_model_as_configured(default_model_dir):
    """The default model's own config, dtype and defaults: at least one max_model_len sequence, at most the cap."""
    from vx.config import EngineArgs
    from vx.gpu.kv_cache import bytes_per_block

    config = EngineArgs(model=default_model_dir, device="cpu").create_config()
    mc, sc, cc = config.model_config, config.scheduler_config, config.cache_config
    per_block = bytes_per_block(mc, cc.block_size, mc.dtype)
    cap = cpu_kv_cap_bytes(64 * GiB)
    size = size_kv_cache(device="cpu", block_size=cc.block_size, bytes_per_block=per_block,
                         max_model_len=mc.max_model_len, max_num_seqs=sc.max_num_seqs, device_budget_bytes=cap)
    assert size.num_blocks >= -(-mc.max_model_len // cc.block_size) + 1
    assert size.num_bytes <= cap and size.source in ("need", "cap")


def test_at_least_one_max_model_len_sequence():
    size = cpu(max_num_seqs=1)
    assert size.source == "need" and size.num_blocks == 8192 // BS + 1


def test_a_short_max_model_len_reserves_no_more_than_it_per_sequence():
    size = cpu(max_model_len=100)
    assert size.num_blocks == 64 * -(-100 // BS) + 1


def test_the_cap_cuts_need():
    size = cpu(max_num_seqs=256)
    assert size.source == "cap" and size.num_blocks == 4 * GiB // PER_BLOCK
    assert "cut to the CPU cap" in size.reason


def test_the_cpu_cap_is_the_old_budget():
    assert cpu_kv_cap_bytes(64 * GiB) == 4 * GiB
    assert cpu_kv_cap_bytes(8 * GiB) == 2 * GiB


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_num_kv_blocks_wins(device):
    size = cpu(device=device, num_kv_blocks=10_000)  # above need and above the cap
    assert size.num_blocks == 10_000 and size.source == "num_kv_blocks" and "num_kv_blocks" in size.reason


def test_kv_cache_memory_bytes_wins_on_cpu():
    small = cpu(kv_cache_memory_bytes=1000 * PER_BLOCK + 5)
    assert small.num_blocks == 1000 and small.source == "kv_cache_memory_bytes"
    large = cpu(kv_cache_memory_bytes=100 * GiB, device_budget_bytes=0)  # above the cap: the user's choice
    assert large.num_blocks == 64 * 8192 // BS + 1  # but no more than max_num_seqs full sequences can use
    assert "all that max_num_seqs=64 sequences" in large.reason


def test_cuda_takes_its_budget_up_to_what_can_be_used():
    size = cpu(device="cuda", device_budget_bytes=2 * GiB)
    assert size.source == "gpu_memory_utilization" and size.num_blocks == 2 * GiB // PER_BLOCK


@pytest.mark.parametrize("kw", [dict(kv_cache_memory_bytes=100 * PER_BLOCK), dict(device_budget_bytes=100 * PER_BLOCK),
                                dict(device="cuda", device_budget_bytes=-GiB)])
def test_a_budget_below_one_sequence_is_refused(kw):
    with pytest.raises(ValueError, match=r"holds -?\d+ blocks, fewer than one sequence of max_model_len=8192 needs "
                                         r"\(513\)"):
        cpu(**kw)


def test_the_description_says_size_blocks_tokens_and_why():
    text = cpu().describe()
    assert text.startswith("KV cache 1,440.7 MiB: 2,049 KV blocks of 16 tokens (32,768 tokens), from need: ")
    assert "max_num_seqs=64 x 512 tokens" in text and "max_model_len=8192" in text and "4,096 MiB" in text
