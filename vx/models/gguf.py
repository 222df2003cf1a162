"""Write a GGUF file's model directory, once: config.json, generation_config.json and the tokenizer (with its chat
template), read from the file's metadata by transformers. No weights: config.json's `quantization_config`
({"quant_method": "gguf", "gguf_file": path}) points the engine at the file, which it loads quantized
(vx/models/gguf_weights.py).

Run as `python -m vx.models.gguf SRC.gguf DST_DIR`: the front end starts it in a child process, so the
application's process never imports torch (transformers does).
"""

from __future__ import annotations

import json
import os
import sys

from vx.models.gguf_weights import SUPPORTED_ARCHITECTURES


def gguf_architecture(path: str) -> str:
    """The `general.architecture` of a GGUF file (read with the gguf package, header only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as e:  # the gguf package raises many kinds on a bad file
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def write_gguf_config(src: str, dst: str) -> None:
    """Write config.json (pointing at `src`), generation_config.json and the tokenizer files into `dst`."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = gguf_architecture(src)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    src = os.path.realpath(src)
    folder, name = os.path.split(src)
    os.makedirs(dst, exist_ok=True)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    cfg = config.to_dict()
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    cfg["quantization_config"] = {"quant_method": "gguf", "gguf_file": src}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {"eos_token_id": cfg.get("eos_token_id"), "bos_token_id": cfg.get("bos_token_id")}
    if tokenizer.eos_token_id is not None:
        gen["eos_token_id"] = tokenizer.eos_token_id
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    tokenizer.save_pretrained(dst)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m vx.models.gguf SRC.gguf DST_DIR", file=sys.stderr)
        return 2
    try:
        write_gguf_config(args[0], args[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
