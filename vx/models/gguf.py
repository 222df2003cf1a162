"""Convert a GGUF checkpoint into a Hugging Face safetensors directory, once.

transformers reads the GGUF config and tokenizer and dequantizes the weights (no hand-written
dequantization here); we save the result as float32 safetensors so later starts load in well under a
second. Run as `python -m vx.models.gguf SRC.gguf DST_DIR`: the front end starts it in a child process
so the application's process never imports torch model code.
"""

from __future__ import annotations

import json
import os
import sys

_SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def gguf_architecture(path: str) -> str:
    """The `general.architecture` of a GGUF file (read with the gguf package, header only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as e:  # the gguf package raises many kinds on a bad file
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def convert_gguf(src: str, dst: str) -> None:
    """Write config.json, generation_config.json, tokenizer files and model.safetensors into `dst`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    arch = gguf_architecture(src)
    if arch not in _SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(_SUPPORTED_GGUF_ARCHS)}.")
    folder, name = os.path.split(os.path.abspath(src))
    os.makedirs(dst, exist_ok=True)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt", "source": os.path.basename(src)})

    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = [type(model).__name__]
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
        convert_gguf(args[0], args[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
