"""The bundled default model: vx equals Hugging Face greedy on the same dequantized weights, and chats."""

from __future__ import annotations

import os

import pytest
import torch

import vx

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer in one sentence.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def llm(default_model_dir):
    engine = vx.LLM(None, dtype="float32", device="cpu")
    yield engine
    engine.shutdown()


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_equals_hf_on_gguf_weights(llm, default_model_dir):
    from transformers import AutoModelForCausalLM

    prompts = [_chat_ids(llm.tokenizer, q) for q in QUESTIONS]
    params = vx.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    # The directory holds transformers' own dequantization of the GGUF file, saved as safetensors.
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        want = out[0, len(p):].tolist()
        assert got[i] == want, f"prompt {i} ({QUESTIONS[i]!r}) differs:\n vx: {got[i]}\n hf: {want}"


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   vx.SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on the template's end-of-turn token


def test_second_start_uses_safetensors_cache(default_model_dir):
    from vx.model_source import converted_dir_for, default_model_file, resolve_model

    assert resolve_model(None) == default_model_dir == converted_dir_for(default_model_file())
    assert os.path.isfile(os.path.join(default_model_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(default_model_dir, ".vx-complete"))
