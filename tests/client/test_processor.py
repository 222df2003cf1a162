"""Processor: validation of every bad input, tokenization, max_tokens clamping; tokenizer loading."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from tests.support.app_process import MODEL_SIDE_CHECK
from vx.client.processor import Processor
from vx.client.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
from vx.core.protocol import EngineCoreRequest
from vx.sampling_params import SamplingParams


@pytest.fixture
def processor(make_model_config, tokenizer) -> Processor:
    return Processor(make_model_config(max_model_len=64), tokenizer)


# ------------------------------------------------------------------ happy paths
def test_text_prompt_is_tokenized_with_special_tokens(processor, tokenizer):
    req = processor.process_inputs("r1", "The capital of France is", None)
    assert isinstance(req, EngineCoreRequest)
    assert req.prompt_token_ids == tokenizer.encode("The capital of France is", add_special_tokens=True)
    assert req.request_id == "r1" and req.sampling_params == SamplingParams()
    assert req.arrival_time > 0 and req.priority == 0


def test_encode_is_called_with_add_special_tokens(make_model_config):
    calls = []

    class BosTokenizer:  # prepends a BOS only when asked to, like Llama's tokenizer
        eos_token_id = 2

        def encode(self, text, add_special_tokens=False):
            calls.append(add_special_tokens)
            return ([1] if add_special_tokens else []) + [5, 6]

    req = Processor(make_model_config(), BosTokenizer()).process_inputs("r", "hi", None)
    assert calls == [True] and req.prompt_token_ids == [1, 5, 6]


def test_token_prompt_passes_through_copied(processor):
    ids = [5, 6, 7]
    req = processor.process_inputs("r", ids, SamplingParams(max_tokens=3), arrival_time=12.5, priority=3)
    assert req.prompt_token_ids == ids and req.prompt_token_ids is not ids
    assert req.arrival_time == 12.5 and req.priority == 3


def test_priority_falls_back_to_params(processor):
    assert processor.process_inputs("r", [1], SamplingParams(priority=-4)).priority == -4


def test_eos_ids_merge_model_config_and_tokenizer(make_model_config, tokenizer):
    p = Processor(make_model_config(eos_token_ids=(7, 0)), tokenizer)
    assert p.process_inputs("r", [1], None).eos_token_ids == [7, 0]
    p = Processor(make_model_config(eos_token_ids=(7,)), tokenizer)
    assert p.process_inputs("r", [1], None).eos_token_ids == [7, tokenizer.eos_token_id]


def test_request_survives_the_wire(processor):
    req = processor.process_inputs("r", "Hello, world!", SamplingParams(stop=["!"], max_tokens=4))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req


def test_bad_words_are_tokenized_with_and_without_a_leading_space(processor, tokenizer):
    words = ["world", "  Hello there", "!", ""]
    req = processor.process_inputs("r", [1], SamplingParams(bad_words=words))
    want = []
    for w in words:  # vLLM's rule: the word as is, plus " word" when that is another token sequence as long
        plain = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        want.append(plain)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(spaced)
    assert req.bad_words_token_ids == want and len(want) >= 3
    assert tokenizer.encode(" world", add_special_tokens=False) in want  # this tokenizer has " world" as a token
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req
    assert processor.process_inputs("r", [1], None).bad_words_token_ids is None


def test_bad_words_need_a_tokenizer(make_model_config):
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        Processor(make_model_config(), None).process_inputs("r", [1], SamplingParams(bad_words=["x"]))


# ------------------------------------------------------------------ max_tokens clamping
@pytest.mark.parametrize(
    "max_tokens, prompt_len, expected",
    [(None, 10, 54), (None, 63, 1), (1000, 10, 54), (54, 10, 54), (5, 10, 5), (1, 63, 1)],
)
def test_max_tokens_clamped_to_room(processor, max_tokens, prompt_len, expected):
    params = SamplingParams(max_tokens=max_tokens)
    req = processor.process_inputs("r", [3] * prompt_len, params)
    assert req.sampling_params.max_tokens == expected
    assert params.max_tokens == max_tokens  # the caller's params are never changed


def test_min_tokens_clamped_with_max_tokens(processor):
    req = processor.process_inputs("r", [3] * 60, SamplingParams(max_tokens=20, min_tokens=10))
    assert req.sampling_params.max_tokens == 4 and req.sampling_params.min_tokens == 4


def test_params_object_reused_when_nothing_changes(processor):
    params = SamplingParams(max_tokens=8)
    assert processor.process_inputs("r", [3], params).sampling_params is params


# ------------------------------------------------------------------ validation errors
def _err(processor, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        processor.process_inputs(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("rid", ["", None, 3, b"r"])
def test_bad_request_id(processor, rid):
    assert "request_id" in _err(processor, rid, [1], None)


@pytest.mark.parametrize("params", [{"max_tokens": 3}, 3, "greedy"])
def test_params_of_wrong_type(processor, params):
    assert "SamplingParams" in _err(processor, "r", [1], params)


def test_n_greater_than_one_is_one_request_with_n(processor):
    # The fan-out into n engine requests happens in the OutputProcessor; the processor keeps n as given.
    req = processor.process_inputs("r", [1], SamplingParams(n=2))
    assert req.request_id == "r" and req.sampling_params.n == 2


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(processor, prompt):
    assert "empty" in _err(processor, "r", prompt, None)


def test_text_that_tokenizes_to_nothing(make_model_config):
    class NothingTokenizer:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=True):
            return []

    assert "zero tokens" in _err(Processor(make_model_config(), NothingTokenizer()), "r", "   ", None)


@pytest.mark.parametrize("prompt", [(1, 2), 5, None, b"abc", {"a": 1}])
def test_prompt_of_wrong_type(processor, prompt):
    assert "str or a list[int]" in _err(processor, "r", prompt, None)


@pytest.mark.parametrize("bad", [1.0, True, "3", None])
def test_token_ids_must_be_ints(processor, bad):
    msg = _err(processor, "r", [1, bad], None)
    assert "position 1" in msg and "must be an int" in msg


@pytest.mark.parametrize("bad", [-1, 512, 10**9])
def test_token_ids_must_be_in_vocab(processor, bad):
    msg = _err(processor, "r", [1, 2, bad], None)
    assert f"{bad}" in msg and "[0, 512)" in msg


def test_tokenized_text_is_checked_against_model_vocab(make_model_config, tokenizer):
    # A tokenizer larger than the model's vocabulary must not smuggle ids past the check.
    p = Processor(make_model_config(vocab_size=200), tokenizer)
    assert "[0, 200)" in _err(p, "r", "héllo wörld 日本", None)


def test_prompt_too_long(processor):
    processor.process_inputs("ok", [1] * 63, None)  # 63 + 1 generated token == max_model_len
    msg = _err(processor, "r", [1] * 64, None)
    assert "64 tokens" in msg and "max_model_len is 64" in msg
    msg = _err(processor, "r", "Paris " * 100, None)
    assert "max_model_len is 64" in msg


def test_stop_token_ids_outside_vocab(processor):
    assert "stop_token_ids" in _err(processor, "r", [1], SamplingParams(stop_token_ids=[3, 512]))


def test_logit_bias_key_outside_vocab(processor):
    assert "logit_bias" in _err(processor, "r", [1], SamplingParams(logit_bias={600: 1.0}))


def test_top_k_at_most_the_vocabulary(processor):
    assert processor.process_inputs("r", [1], SamplingParams(top_k=512)).sampling_params.top_k == 512
    assert processor.process_inputs("r", [1], SamplingParams(top_k=-1)).sampling_params.top_k == 0  # all
    msg = _err(processor, "r", [1], SamplingParams(top_k=513))
    assert "top_k=513" in msg and "vocabulary size (512)" in msg
    assert "top_k" in _err(processor, "r", [1], SamplingParams(top_k=2**62))


def test_n_at_most_max_n_sequences(make_model_config, tokenizer):
    p = Processor(make_model_config(), tokenizer, max_n_sequences=4)
    assert p.process_inputs("r", [1], SamplingParams(n=4)).sampling_params.n == 4
    msg = _err(p, "r", [1], SamplingParams(n=5))
    assert "n=5" in msg and "max_n_sequences (4)" in msg
    # The default is the engine argument's default.
    from vx.config import EngineArgs

    assert Processor(make_model_config(), tokenizer).max_n_sequences == EngineArgs().max_n_sequences == 128


def test_eos_ids_outside_the_model_vocabulary_are_dropped(make_model_config, tokenizer):
    p = Processor(make_model_config(vocab_size=512, eos_token_ids=(7, 900)), tokenizer)
    assert p.process_inputs("r", [1], None).eos_token_ids == [7, 0]


@pytest.mark.parametrize("kw", [{"priority": 1.5}, {"priority": True}, {"arrival_time": "now"}])
def test_bad_priority_or_arrival_time(processor, kw):
    with pytest.raises(ValueError):
        processor.process_inputs("r", [1], None, **kw)


def test_no_tokenizer_accepts_token_ids_only(make_model_config):
    p = Processor(make_model_config(), None)
    assert p.process_inputs("r", [1, 2], None).prompt_token_ids == [1, 2]
    assert "tokenizer" in _err(p, "r", "text", None)
    assert "tokenizer" in _err(p, "r", [1], SamplingParams(stop=["x"]))


# ------------------------------------------------------------------ tokenizer loading
def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="No tokenizer found"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="Could not load"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_helpers(tokenizer):
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 0
    assert special_token_ids(tokenizer) == {0, 1, 2}
    assert eos_token_ids(tokenizer, [9, 0]) == [9, 0]
    assert len(tokenizer) <= 400
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_tokenizer_is_deterministic(tmp_path, tiny_tokenizer_dir):
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    make_tiny_tokenizer(str(tmp_path))
    with open(tmp_path / "tokenizer.json") as a, open(os.path.join(tiny_tokenizer_dir, "tokenizer.json")) as b:
        assert a.read() == b.read()


def test_client_modules_do_not_import_torch(tiny_tokenizer_dir):
    code = (
        "import sys\n"
        "import vx.client.tokenizer, vx.client.processor, vx.client.output_processor, vx.client.detokenizer\n"
        f"tok = vx.client.tokenizer.load_tokenizer({tiny_tokenizer_dir!r})\n"
        "tok.encode('hello'); tok.decode([1, 2])\n"
        + MODEL_SIDE_CHECK +
        "assert not bad, bad\n"
    )
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ------------------------------------------------------------------ embedding requests
def test_a_pooling_request_is_tokenized_and_may_fill_the_context(processor, tokenizer):
    from vx.pooling_params import PoolingParams

    params = PoolingParams(pooling_type="mean")
    req = processor.process_inputs("e1", "Hello there", params)
    assert req.pooling_params == params and req.prompt_token_ids == tokenizer.encode("Hello there")
    assert req.eos_token_ids == [] and req.sampling_params.logprobs is None
    full = processor.process_inputs("e2", [5] * 64, PoolingParams())  # nothing is generated: 64 of 64 fit
    full.verify_for_model(512, 64)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        processor.process_inputs("e3", [5] * 65, PoolingParams())
    with pytest.raises(ValueError, match="must have 1 to 64 tokens"):
        msgspec.structs.replace(full, prompt_token_ids=[5] * 65).verify_for_model(512, 64)
    with pytest.raises(ValueError, match="empty"):
        processor.process_inputs("e4", "", PoolingParams())
    with pytest.raises(ValueError, match="no Matryoshka"):  # the model's config declares none
        processor.process_inputs("e5", "hi", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="samples nothing"):
        msgspec.structs.replace(full, sampling_params=SamplingParams(logprobs=2)).verify_for_model(512, 64)
