"""`/v1/embeddings` through the official `openai` client: float and base64, batches in OpenAI's four input forms,
usage, vx's pooling extras, Matryoshka `dimensions` (only where the model's config allows them), and 400s for bad
input."""

from __future__ import annotations

import base64
import json
import math
import shutil
import struct

import openai
import pytest

from tests.support.server import API_KEY, start_server, stop_server


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from vx.client.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_float_and_base64_give_the_same_normalised_embedding(client):
    floats = client.embeddings.create(model="tiny", input="The quick brown fox", encoding_format="float")
    (item,) = floats.data
    assert floats.object == "list" and floats.model == "tiny" and item.object == "embedding" and item.index == 0
    assert len(item.embedding) == 64 and abs(_norm(item.embedding) - 1.0) < 1e-5
    assert floats.usage.prompt_tokens > 0 and floats.usage.total_tokens == floats.usage.prompt_tokens
    b64 = client.embeddings.create(model="tiny", input="The quick brown fox", encoding_format="base64")
    assert _close(_decode(b64.data[0].embedding), item.embedding)  # asked for explicitly: the client keeps the text
    # Without encoding_format the client asks for base64 itself, and decodes it.
    default = client.embeddings.create(model="tiny", input="The quick brown fox")
    assert _close(default.data[0].embedding, item.embedding)


def _decode(text: str) -> list[float]:
    """OpenAI's base64 embedding: float32 values, little-endian."""
    data = base64.b64decode(text)
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def test_raw_base64_is_little_endian_float32(http):
    floats = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "float"}).json()
    raw = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json()
    assert len(base64.b64decode(raw["data"][0]["embedding"])) == 4 * 64
    assert _close(_decode(raw["data"][0]["embedding"]), floats["data"][0]["embedding"])


def test_a_batch_in_every_input_form_keeps_its_order(client, tokenizer):
    texts = ["alpha", "a longer second input, of several more tokens", "gamma"]
    by_text = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in by_text.data] == [0, 1, 2]
    token_ids = [tokenizer.encode(t) for t in texts]  # as the server tokenizes text (with special tokens)
    by_ids = client.embeddings.create(model="tiny", input=token_ids, encoding_format="float")
    one_ids = client.embeddings.create(model="tiny", input=token_ids[1], encoding_format="float")
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == sum(len(t) for t in token_ids)
    for a, b in zip(by_text.data, by_ids.data):
        assert _close(a.embedding, b.embedding, 1e-5)
    assert len(one_ids.data) == 1 and _close(one_ids.data[0].embedding, by_text.data[1].embedding, 1e-5)
    assert not _close(by_text.data[0].embedding, by_text.data[2].embedding, 1e-3)


def test_pooling_extras(client):
    text = "Mean pooling differs from the last token"
    last = client.embeddings.create(model="tiny", input=text, encoding_format="float").data[0].embedding
    mean = client.embeddings.create(model="tiny", input=text, encoding_format="float",
                                    extra_body={"pooling_type": "mean"}).data[0].embedding
    raw = client.embeddings.create(model="tiny", input=text, encoding_format="float",
                                   extra_body={"normalize": False}).data[0].embedding
    assert abs(_norm(mean) - 1.0) < 1e-5 and not _close(mean, last, 1e-3)
    assert abs(_norm(raw) - 1.0) > 1e-3 and _close([x / _norm(raw) for x in raw], last, 1e-4)


@pytest.mark.parametrize("body, param, match", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [[]]}, "input", "empty token list"),
    ({"input": [5] * 1025}, "input", "at most 1024 tokens"),
    ({"input": ["a"] * 2049}, "input", "at most 2048 (--max-prompts"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "no Matryoshka"),
    ({"input": "hi", "pooling_type": "cls"}, "pooling_type", ""),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
])
def test_bad_input_is_a_400(http, body, param, match):
    resp = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and match in error["message"]


def test_bad_input_through_the_client_and_a_full_context(client):
    with pytest.raises(openai.BadRequestError, match="no Matryoshka"):
        client.embeddings.create(model="tiny", input="hi", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    full = client.embeddings.create(model="tiny", input=[5] * 1024, encoding_format="float")  # fills max_model_len
    assert full.usage.prompt_tokens == 1024 and len(full.data[0].embedding) == 64


@pytest.fixture(scope="module")
def matryoshka_client(tiny_model_dir, tmp_path_factory):
    """A server of the tiny model with `matryoshka_dimensions` in its config.json (cuts to 16 or 32 allowed)."""
    folder = tmp_path_factory.mktemp("serve-matryoshka")
    model_dir = folder / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (model_dir / "config.json").write_text(json.dumps(config))
    server = start_server(str(model_dir), str(folder / "server.log"), "--served-model-name", "tiny-mrl",
                          "--dtype", "float32")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    stop_server(server)


def test_dimensions_cut_then_renormalise_where_the_model_allows(matryoshka_client):
    text = "Matryoshka embeddings keep their meaning when cut"
    raw = matryoshka_client.embeddings.create(model="tiny-mrl", input=text, encoding_format="float",
                                              extra_body={"normalize": False}).data[0].embedding
    cut = matryoshka_client.embeddings.create(model="tiny-mrl", input=text, dimensions=16).data[0].embedding
    head = raw[:16]
    assert len(cut) == 16 and _close(cut, [x / _norm(head) for x in head], 1e-5)
    with pytest.raises(openai.BadRequestError, match=r"matryoshka_dimensions \[16, 32\]"):
        matryoshka_client.embeddings.create(model="tiny-mrl", input=text, dimensions=20)


def test_embedding_requests_are_counted(http):
    from tests.support.server import metric

    ok = 'endpoint="/v1/embeddings",finish_reason="stop"'
    error = 'endpoint="/v1/embeddings",finish_reason="error"'
    before_ok, before_error = metric(http, "vx_requests_total", ok), metric(http, "vx_requests_total", error)
    before_tokens = metric(http, "vx_prompt_tokens_total", 'endpoint="/v1/embeddings"')
    assert http.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).status_code == 200
    assert http.post("/v1/embeddings", json={"input": ""}).status_code == 400
    assert metric(http, "vx_requests_total", ok) == before_ok + 2
    assert metric(http, "vx_requests_total", error) == before_error + 1
    assert metric(http, "vx_prompt_tokens_total", 'endpoint="/v1/embeddings"') == before_tokens + 5
