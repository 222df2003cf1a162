"""Build a model from a Hugging Face directory of safetensors files, or from the source its quantization names
(a GGUF file: `QuantizationConfig.weights`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from vx.config.checkpoint_files import safetensors_files
from vx.config.model_limits import check_model_config
from vx.models.layers.quantization import QuantizationConfig, process_weights_after_loading
from vx.models.registry import resolve_model_class
from vx.platform import release_free_heap

if TYPE_CHECKING:
    from vx.distributed import GroupCoordinator


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in the target dtype (no float32 copy of a large model first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) from each file; an unreadable or corrupted file raises ValueError."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError for a bad file
            raise ValueError(f"Cannot read weights file {path!r} (missing or corrupted?): {e}") from e


def checkpoint_weights(model_path: str, hf_config: Any,
                       quant_config: QuantizationConfig | None) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs: from the quantization's own source when it has one, else from the
    directory's safetensors files. Checks what it can (files there, readable) before anything is loaded."""
    source = quant_config.weights(model_path, hf_config) if quant_config is not None else None
    return source if source is not None else iterate_safetensors(safetensors_files(model_path))


class DefaultModelLoader:
    """Builds the registered model class for the config's architecture and fills it from its checkpoint."""

    def load_model(self, model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                   quant_config: QuantizationConfig | None = None, tp_group: GroupCoordinator | None = None,
                   pp_group: GroupCoordinator | None = None) -> nn.Module:
        """Model in `dtype` on `device`, every parameter loaded and readied by its quantization method, in eval
        mode; with `tp_group`, this rank's shard of it (each layer takes its slice of the checkpoint's tensors);
        with `pp_group`, only its pipeline stage's layers."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs:
            raise ValueError("The model config names no 'architectures'; cannot pick a model class.")
        model_cls = resolve_model_class(archs[0])
        # The config may not have come through EngineArgs (which checked it): nothing is allocated from bad shapes.
        check_model_config(hf_config, f"the model config of {model_path!r}")
        if quant_config is not None:
            quant_config.verify(torch.device(device), dtype)
            quant_config.packed_modules_mapping = getattr(model_cls, "packed_modules_mapping", {})
        weights = checkpoint_weights(model_path, hf_config, quant_config)
        try:
            with torch.no_grad(), _default_dtype(dtype), torch.device(device):
                groups = {name: g for name, g in (("tp_group", tp_group), ("pp_group", pp_group)) if g is not None}
                model = model_cls(hf_config, quant_config, **groups)
            with torch.no_grad():
                loaded = model.load_weights(weights)
            missing = sorted(set(dict(model.named_parameters())) - loaded)
            if missing:
                shown = ", ".join(missing[:10]) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
                raise ValueError(f"Checkpoint in {model_path!r} did not provide these parameters: {shown}.")
            with torch.no_grad():
                process_weights_after_loading(model)
        finally:
            close = getattr(weights, "close", None)
            if close is not None:  # a source that holds files open (a GGUF file) lets them go
                close()
        release_free_heap()
        model.requires_grad_(False)
        return model.eval()

