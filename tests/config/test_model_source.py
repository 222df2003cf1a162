"""Models by Hugging Face id (vx/config/model_source.py): an id resolves from the Hugging Face cache offline and
generates, a missing id gets an error that names it, a download happens only when allowed, and never while only
validating.
No test touches the network: the cache is built here, and the download itself is replaced."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests.support.engine_processes import ENGINE_KWARGS

import vx
from vx.config import model_source

REPO_ID = "vx-tests/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(hub_cache: str, repo_id: str, model_dir: str) -> str:
    """Lay `model_dir`'s files out as the Hugging Face cache holds a downloaded repository (blobs named by hash,
    snapshots/<commit>/ linking to them, refs/main naming the commit); returns the snapshot folder."""
    repo = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(snapshot)
    for name in sorted(os.listdir(model_dir)):
        with open(os.path.join(model_dir, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    return snapshot


def _offline_env(hf_home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return dict(env, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


_GENERATE_BY_ID = textwrap.dedent("""
    import json, sys
    import anyio
    import vx
    from vx.config.model_source import resolve_model

    repo_id, kwargs = sys.argv[1], json.loads(sys.argv[2])
    params = vx.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    result = {"resolved": resolve_model(repo_id)}
    result["llm"] = vx.LLM(repo_id, **kwargs).generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids

    async def stream():
        async with vx.AsyncLLM(repo_id, **kwargs) as llm:
            return [out.outputs[0].token_ids async for out in llm.generate("hello", params)][-1]

    result["async"] = anyio.run(stream)
    print(json.dumps(result))
""")


def test_an_id_in_the_hugging_face_cache_resolves_offline_and_generates(tiny_model_dir, tmp_path):
    hf_home = tmp_path / "hf"
    snapshot = build_hub_cache(str(hf_home / "hub"), REPO_ID, tiny_model_dir)
    res = subprocess.run([sys.executable, "-c", _GENERATE_BY_ID, REPO_ID, json.dumps(ENGINE_KWARGS)],
                         capture_output=True, text=True, env=_offline_env(hf_home), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.splitlines()[-1])
    assert result["resolved"] == snapshot
    expected = vx.LLM(tiny_model_dir, **ENGINE_KWARGS).generate(
        ["hello"], vx.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert result["llm"] == result["async"] == list(expected[0].outputs[0].token_ids)


_MISSING_ID = textwrap.dedent("""
    import vx
    for make in (vx.LLM, vx.AsyncLLM):
        try:
            make("vx-tests/no-such-model")
        except ValueError as e:
            print(e)
""")


def test_an_id_missing_from_the_cache_offline_is_a_clear_error(tiny_model_dir, tmp_path):
    hf_home = tmp_path / "hf"
    build_hub_cache(str(hf_home / "hub"), REPO_ID, tiny_model_dir)  # a cache that holds another model
    res = subprocess.run([sys.executable, "-c", _MISSING_ID], capture_output=True, text=True,
                         env=_offline_env(hf_home), cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout  # both vx.LLM and vx.AsyncLLM refused it
    for line in lines:
        assert line.startswith("model 'vx-tests/no-such-model' is neither a local path nor in the Hugging Face "
                               f"cache ({hf_home / 'hub'})"), line
        assert "HF_HUB_OFFLINE" in line


class FakeHub:
    """Stands in for `huggingface_hub.snapshot_download`: nothing cached; a download gives `folder` (or fails)."""

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        self.downloads: list[dict] = []

    def __call__(self, repo_id: str, **kwargs):
        from huggingface_hub.errors import LocalEntryNotFoundError

        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not in the cache")
        self.downloads.append(dict(kwargs, repo_id=repo_id))
        if self.folder is None:
            raise OSError("network unreachable")
        return self.folder


@pytest.fixture
def online(monkeypatch):
    """An online Hugging Face hub whose downloads go through a FakeHub (installed by the test)."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def install(folder: str | None) -> FakeHub:
        hub = FakeHub(folder)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
        return hub

    return install


def test_online_an_id_downloads_only_when_resolved_not_when_validated(online, tiny_model_dir):
    hub = online(tiny_model_dir)
    assert model_source.resolve_model(REPO_ID, convert=False) == REPO_ID  # AsyncLLM(...) validates only
    assert hub.downloads == []
    assert model_source.resolve_model(REPO_ID) == tiny_model_dir
    assert [d["repo_id"] for d in hub.downloads] == [REPO_ID]
    patterns = hub.downloads[0]["allow_patterns"]  # what a model needs, not every file of the repository
    assert "*.safetensors" in patterns and "*.json" in patterns and not any("bin" in p for p in patterns)


def test_a_tokenizer_by_id_resolves_like_a_model(online, tiny_model_dir):
    hub = online(tiny_model_dir)
    assert model_source.resolve_tokenizer(REPO_ID) == tiny_model_dir
    assert model_source.resolve_tokenizer(tiny_model_dir) == tiny_model_dir  # a directory stays as it is
    assert [d["repo_id"] for d in hub.downloads] == [REPO_ID]
    config = vx.EngineArgs(model=tiny_model_dir, tokenizer=REPO_ID, device="cpu").create_config(light=True)
    assert config.model_config.tokenizer == tiny_model_dir


def test_online_a_failed_download_names_the_id(online):
    online(None)
    with pytest.raises(ValueError, match=r"model 'vx-tests/tiny-qwen3' is neither a local path nor in the Hugging "
                                         r"Face cache, and downloading it .* failed: OSError: network unreachable"):
        model_source.resolve_model(REPO_ID)


@pytest.mark.parametrize("model, is_id", [
    ("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("/no/such/dir", False), ("./model", False),
    ("~/models/x", False), ("a/b/c", False), ("org/na me", False),
])
def test_what_counts_as_a_hugging_face_id(model, is_id):
    assert model_source.is_hub_id(model) is is_id


def test_a_missing_path_is_not_looked_up_on_the_hub(online, tmp_path):
    hub = online(None)
    with pytest.raises(ValueError, match="does not exist"):
        model_source.resolve_model(str(tmp_path / "no-such-model"))
    assert hub.downloads == []
