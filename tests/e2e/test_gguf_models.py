"""GGUF files run natively end to end: for every type vx loads, greedy decoding from the file equals greedy decoding
of the same weights dequantized by gguf through vx's float path; a file goes from its path to a chat; a type vx
cannot load is refused at start with the type and the tensor named, and nothing is left running."""

from __future__ import annotations

import os

import pytest
import torch
from tests.support.kernel_cache import share_kernels
from tests.support.engine_processes import ENGINE_KWARGS, child_pids

import vx
from vx.models.gguf.config import write_gguf_config

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """Greedy tokens equal the dequantized twin's only on the exact float path: the int8-activation path (the
    default on VNNI CPUs) rounds x per group, which flips near-tied tokens of these tiny random models. The engine
    process inherits the variable."""
    monkeypatch.setenv("VX_CPU_MATMUL", "float")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
NEW_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 24, (8,), generator=g)]


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = vx.LLM(model, **ENGINE_KWARGS)
    try:
        params = vx.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """`config_dir(tiny)`: the GGUF file's config directory, written in this process (the child process that
    writes it for `model=path.gguf` is tested once below)."""
    def make(tiny) -> str:
        folder = str(tmp_path_factory.mktemp("gguf-config"))
        write_gguf_config(tiny.gguf_path, folder)
        return folder

    return make


@pytest.mark.parametrize("types", TYPES)
def test_greedy_from_the_file_equals_greedy_on_its_dequantized_weights(tiny_gguf, config_dir, types):
    tiny = tiny_gguf(types, tied=types == "Q8_0")
    prompts = _prompts(tiny.vocab_size)
    assert _greedy(config_dir(tiny), prompts) == _greedy(tiny.float_dir, prompts)


@pytest.mark.parametrize("types", ["Q8_0", "Q4_K"])
def test_a_gemma3_file_equals_its_dequantized_twin(tiny_gguf, config_dir, types):
    """Gemma 3 as llama.cpp writes it (norms stored plus one, q/k unpermuted, 5 sliding layers of window 16 to 1
    global one) decodes greedily as its safetensors twin, over prompts and answers that cross the window."""
    tiny = tiny_gguf(types, family="gemma3")
    prompts = _prompts(tiny.vocab_size)
    assert _greedy(config_dir(tiny), prompts) == _greedy(tiny.float_dir, prompts)
    # Greedy tokens of a random model barely notice a norm's scale; its prompt logprobs do.
    assert _prompt_logprobs(config_dir(tiny), prompts) == pytest.approx(_prompt_logprobs(tiny.float_dir, prompts),
                                                                        abs=2e-3)


def _prompt_logprobs(model: str, prompts: list[list[int]]) -> list[float]:
    llm = vx.LLM(model, **ENGINE_KWARGS)
    try:
        outs = llm.generate(prompts, vx.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    return [entry[token].logprob for out, prompt in zip(outs, prompts)
            for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]


def test_a_gguf_path_chats(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("VX_CACHE_DIR", str(tmp_path / "cache"))
    share_kernels(tmp_path / "cache")
    tiny = tiny_gguf("Q4_K_M")
    llm = vx.LLM(tiny.gguf_path, **ENGINE_KWARGS)
    try:
        out = llm.chat([{"role": "user", "content": "Hello"}], vx.SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) > 0
        # The chat template and the tokenizer came from the file's metadata.
        assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith(
            "<|im_start|>user\nHi<|im_end|>")
    finally:
        llm.shutdown()
    folders = os.listdir(tmp_path / "cache" / "gguf-config")
    config = [f for f in folders if not f.endswith(".lock")]
    assert len(config) == 1 and not any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "cache" /
                                                                                         "gguf-config" / config[0]))


def test_an_unsupported_type_is_refused_at_start_naming_it(tiny_gguf, config_dir):
    tiny = tiny_gguf("Q2_K")  # refused wherever it appears: here every weight is Q2_K
    model = config_dir(tiny)
    with pytest.raises(ValueError, match=r"GGUF tensor '(token_embd|blk\.\d+\.\w+|output)\.weight' .* has type Q2_K, "
                                         r"which vx cannot load"):
        vx.LLM(model, **ENGINE_KWARGS)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_an_unsupported_type_through_async_llm_leaves_nothing_running(anyio_backend, tiny_gguf, config_dir):
    model = config_dir(tiny_gguf("Q2_K"))
    before = child_pids()
    with pytest.raises(vx.EngineDeadError, match="failed to start: ValueError: .*has type Q2_K"):
        async with vx.AsyncLLM(model, **ENGINE_KWARGS):
            pass
    assert child_pids() <= before


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("types", ["F16", "Q8_0"])
def test_a_newer_family_file_equals_its_dequantized_twin(tiny_gguf, config_dir, family, types):
    """Gemma 2 (soft caps, sliding layers, norms stored plus one), Phi-3 (fused qkv and gate|up, partial rotary,
    LongRoPE), Qwen3-MoE and Mixtral (stacked experts, dequantized into FusedMoE's float stacks when quantized; the
    rest kept quantized) decode greedily and score prompts as their safetensors twins."""
    tiny = tiny_gguf(types, family=family)
    prompts = _prompts(tiny.vocab_size)
    model = config_dir(tiny)
    assert _greedy(model, prompts) == _greedy(tiny.float_dir, prompts)
    assert _prompt_logprobs(model, prompts) == pytest.approx(_prompt_logprobs(tiny.float_dir, prompts), abs=2e-3)


@pytest.mark.parametrize(("family", "kv_b_form"), [("deepseek_v2", "kv_b"), ("deepseek_v2_qlora_yarn", "split")])
@pytest.mark.parametrize("types", ["F16", "Q8_0"])
def test_a_deepseek_v2_file_equals_its_dequantized_twin(tiny_gguf, config_dir, family, kv_b_form, types):
    """DeepSeek-V2 (MLA without and with a q low rank, kv_b_proj as older converters store it and split per head as
    newer ones do, grouped and plain top-k, shared experts, a dense first layer, YaRN with mscale) from its config
    read off the metadata alone: the projections and MLPs quantized, kv_b_proj, the router and the routed experts
    dequantized; it decodes greedily and scores prompts as its safetensors twin."""
    tiny = tiny_gguf(types, family=family, kv_b_form=kv_b_form)
    prompts = _prompts(tiny.vocab_size)
    model = config_dir(tiny)
    assert _greedy(model, prompts) == _greedy(tiny.float_dir, prompts)
    assert _prompt_logprobs(model, prompts) == pytest.approx(_prompt_logprobs(tiny.float_dir, prompts), abs=2e-3)
