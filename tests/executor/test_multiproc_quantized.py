"""A GGUF model split over two tensor-parallel worker processes (gloo) gives the greedy tokens of the whole file in
one process, and its logprobs within 5e-5, through chunked prefill and preemption; a file whose K-quant blocks a
rank would cut in two is refused before any worker starts, naming the layer and the sizes."""

from __future__ import annotations

import pytest
from tests.support.engine_processes import child_pids
from tests.support.parallel_runs import assert_same, prompts, run

import vx

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_config_dir(tiny_gguf, tmp_path_factory):
    """`gguf_config_dir(types)`: the config directory of a tiny Llama GGUF file (weights read from the file)."""
    from vx.models.gguf.config import write_gguf_config

    def make(types: str) -> str:
        tiny = tiny_gguf(types)
        assert max(max(p) for p in prompts()) < tiny.vocab_size
        folder = str(tmp_path_factory.mktemp(f"gguf-config-{types}"))
        write_gguf_config(tiny.gguf_path, folder)
        return folder

    return make


def test_a_gguf_model_over_two_tensor_parallel_workers_equals_the_whole_file(gguf_config_dir, monkeypatch):
    # The exact float path (the workers inherit the variable): with int8 activations (VX_CPU_MATMUL=auto on VNNI
    # CPUs) an activation one float rounding away from an int8 step rounds the other way on one side, which moves
    # logprobs by far more than the ranks' summation order does.
    monkeypatch.setenv("VX_CPU_MATMUL", "float")
    model = gguf_config_dir("Q4_0")
    want, _ = run(model)
    before = child_pids()
    got, stats = run(model, tensor_parallel_size=2)
    assert stats.num_preemptions > 0, "the KV cache was meant to be too small to avoid preemption"
    assert child_pids() <= before, "shutdown left a worker process"
    # The ranks' halves of each row-parallel matmul are summed in another order than one process sums them.
    assert_same(got, want, tol=5e-5)


def test_k_quant_blocks_a_rank_would_cut_are_refused_before_any_worker_starts(gguf_config_dir):
    import json

    # The config directory records the largest block along the row-parallel tensors' rows: Q4_K_M's o_proj is
    # Q4_K and its down_proj Q6_K (blocks of 256); Q4_0's are blocks of 32.
    model = gguf_config_dir("Q4_K_M")
    for types, block in (("Q4_K_M", 256), ("Q4_0", 32)):
        with open(f"{gguf_config_dir(types)}/config.json") as f:
            assert json.load(f)["quantization_config"]["row_parallel_block"] == block
    before = child_pids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: self_attn\.o_proj has 256 input features, 128 per "
                                         r"rank, which is not a multiple of the GGUF file's block of 256"):
        vx.LLM(model, dtype="float32", device="cpu", tensor_parallel_size=2)
    assert child_pids() <= before, "a refused start left a worker process"
