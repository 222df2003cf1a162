"""The AOT decode-graph cache (vx.gpu.graphs.aoti_cache): its key, what it prunes, and how long a compile is
estimated to take."""

from __future__ import annotations

import json
import os
import time

from vx.gpu.graphs import aoti_cache


def test_the_key_is_shared_by_engines_in_and_out_of_process_and_follows_what_the_code_bakes_in(tiny_model_dir):
    """An in-process engine keeps a transformers config, an engine process receives its resolved fields: one key
    for both (a `vx.LLM` and an `AsyncLLM` share packages). Scheduler limits and the seed change no package's code;
    the dtype, the block size or the KV-cache size do."""
    from vx.config import EngineArgs, decode_config, encode_config

    def key(config, num_blocks=64):
        return aoti_cache.cache_key(config, num_blocks, (), 8, 2)

    config = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu").create_config()
    in_process = key(config)
    assert key(decode_config(encode_config(config))) == in_process
    same = EngineArgs(model=tiny_model_dir, dtype="float32", device="cpu", max_num_seqs=3, seed=7,
                      max_num_batched_tokens=512, grammar_compile_workers=1).create_config()
    assert key(same) == in_process
    assert key(config, num_blocks=65) != in_process
    for other in ({"dtype": "bfloat16"}, {"block_size": 32}):
        args = {"model": tiny_model_dir, "dtype": "float32", "device": "cpu", **other}
        assert key(EngineArgs(**args).create_config()) != in_process, other


def test_files_left_by_a_killed_compile_are_removed_once_no_compile_could_still_own_them(tmp_path):
    """A request folder and a half-written package left by a killed engine go at the next compile under that key;
    those of a compile that may still run (younger than twice the child's time limit) stay, as do packages."""
    old_request, old_package = tmp_path / "tmp-request-x", tmp_path / "tmpab12.pt2"
    old_request.mkdir()
    (old_request / "request.json").write_text("{}")
    old_package.write_bytes(b"half")
    young = tmp_path / "tmpcd34.pt2"
    young.write_bytes(b"being written")
    package = tmp_path / "size1.pt2"
    package.write_bytes(b"whole")
    long_ago = time.time() - 2 * aoti_cache.CHILD_TIMEOUT_S - 60
    for path in (old_request, old_package, package):
        os.utime(path, (long_ago, long_ago))
    aoti_cache._remove_stale_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["size1.pt2", "tmpcd34.pt2"]


def test_key_folders_unused_for_a_month_are_removed_and_a_load_marks_a_key_used(tmp_path):
    """Every upgrade of vx or torch makes new keys: folders no engine loaded from or compiled into for
    `UNUSED_KEY_DAYS` go at the next compile, the others stay."""
    root = tmp_path / "decode-graphs"
    old, recent, used = root / "old-key", root / "recent-key", root / "used-key"
    for key in (old, recent, used):
        key.mkdir(parents=True)
        (key / "size1.pt2").write_bytes(b"package")
    month = aoti_cache.UNUSED_KEY_DAYS * 86400.0
    for key, age in ((old, month + 3600), (recent, month - 3600), (used, month + 3600)):
        os.utime(key, (time.time() - age, time.time() - age))
    aoti_cache.mark_used(used)
    aoti_cache._remove_unused_keys(root, month)
    assert sorted(p.name for p in root.iterdir()) == ["recent-key", "used-key"]
    assert (used / "size1.pt2").read_bytes() == b"package"


def test_a_first_compile_is_estimated_from_the_layers_then_at_this_machines_recorded_pace(tmp_path):
    """The estimate a first start prints: the per-layer figure on an empty cache; once a compile is recorded, the
    newest one's seconds per layer (this machine's speed), whatever model it was, for this model's layers."""
    first = aoti_cache.estimate_compile_s(tmp_path, 30)
    assert first == aoti_cache.FIRST_COMPILE_BASE_S + 30 * aoti_cache.FIRST_COMPILE_S_PER_LAYER
    (tmp_path / "old-key").mkdir()
    (tmp_path / "old-key" / "size1.json").write_text(json.dumps({"child_s": 100.0, "layers": 4}))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "size1.json").write_text("{")  # a sidecar being written: skipped
    assert aoti_cache.estimate_compile_s(tmp_path, 2) == 50.0
    (tmp_path / "new-key").mkdir()
    newer = tmp_path / "new-key" / "size2.json"
    newer.write_text(json.dumps({"child_s": 20.0, "layers": 10}))
    os.utime(newer, (time.time() + 10, time.time() + 10))
    assert aoti_cache.estimate_compile_s(tmp_path, 2) == 4.0
