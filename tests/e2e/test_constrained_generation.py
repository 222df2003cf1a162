"""Structured output end to end: JSON-schema output of the bundled default model always parses and validates, and
AsyncLLM (engine in its own process) constrains requests and refuses an uncompilable one alone."""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import pytest

import vx
from vx.errors import EngineGenerateError

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "color": {"enum": ["red", "green", "blue", "yellow"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "likes_cats": {"type": "boolean"},
    },
    "required": ["name", "color", "age", "likes_cats"],
    "additionalProperties": False,
}
ASYNC_ENGINE_KWARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=200, block_size=16)


def test_default_model_json_always_validates(default_model_dir):
    """The must-show: 20 seeded samples at temperature 1 from SmolLM2-135M, every one valid under the schema."""
    llm = vx.LLM(None, dtype="float32", device="cpu")
    try:
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Invent a person. Reply in JSON with name, favourite color, age and "
                                         "whether they like cats."}], tokenize=False, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        so = vx.StructuredOutputsParams(json=PERSON)
        params = [vx.SamplingParams(temperature=1.0, seed=seed, max_tokens=128, structured_outputs=so)
                  for seed in range(20)]
        outs = [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
        for seed, out in enumerate(outs):
            assert out.finish_reason == "stop", (seed, out.text)
            jsonschema.validate(json.loads(out.text), PERSON)
        assert len({o.text for o in outs}) > 1  # really sampled, not one forced answer

        # Any JSON object (json_object=True), greedy.
        out = llm.generate([prompt], vx.SamplingParams(
            temperature=0.0, max_tokens=128, structured_outputs=vx.StructuredOutputsParams(json_object=True)),
            use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    finally:
        llm.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_llm_constrains_and_refuses_alone(anyio_backend, tiny_model_dir):
    """Over the engine process: concurrent constrained, unconstrained and uncompilable requests. Only the
    uncompilable one fails, with an error that names its problem."""
    regex = r"[a-z]{2}-[0-9]{2}"
    results: dict[str, object] = {}

    async def run(name: str, params: vx.SamplingParams) -> None:
        try:
            results[name] = (await llm.complete("hello", params)).outputs[0]
        except EngineGenerateError as e:
            results[name] = e

    async with vx.AsyncLLM(tiny_model_dir, **ASYNC_ENGINE_KWARGS) as llm:
        async with anyio.create_task_group() as tg:
            for seed in range(3):
                tg.start_soon(run, f"json{seed}", vx.SamplingParams(
                    seed=seed, max_tokens=96, structured_outputs=vx.StructuredOutputsParams(json=PERSON)))
            tg.start_soon(run, "regex", vx.SamplingParams(
                seed=5, max_tokens=32, structured_outputs=vx.StructuredOutputsParams(regex=regex)))
            tg.start_soon(run, "bad", vx.SamplingParams(
                max_tokens=8, structured_outputs=vx.StructuredOutputsParams(json={"type": "no-such-type"})))
            tg.start_soon(run, "free", vx.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        stats = await llm.stats()

    assert isinstance(results["bad"], EngineGenerateError)
    assert re.search(r"structured_outputs\.json is invalid: .*no-such-type", str(results["bad"]))
    for seed in range(3):
        jsonschema.validate(json.loads(results[f"json{seed}"].text), PERSON)
    assert re.fullmatch(regex, results["regex"].text)
    assert len(results["free"].token_ids) == 8
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
