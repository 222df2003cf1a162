"""The quantization methods by name, one row each: what `quantization=` and a checkpoint's
`quantization_config.quant_method` may name, where each method's `QuantizationConfig` lives, and how its weights
split over tensor-parallel ranks.

The one place that lists method names. It imports nothing heavy, so the config validates `quantization=` and checks
a split (vx.models.layers.quantization.tp_split) in the application's process, which never imports torch; a
method's own module is imported only when a model uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

GGUF_MIN_BLOCK = 32
"""The smallest block of GGUF's quantized types (Q4_0..Q8_0); the K-quants' super-blocks hold 256."""

_INT4_KERNEL_GROUP = 32  # the 4-bit kernel takes groups that are multiples of 32 (packing.py)


@dataclass(frozen=True)
class SliceAlignment:
    """What a quantized checkpoint asks of each tensor-parallel rank's slice of its weights."""

    multiple: int = 1
    """A row-parallel layer's input features per rank (K / tp) must be a multiple of this."""
    what: str = ""
    """What that multiple is called, for the error message (e.g. "AWQ group_size of 128")."""
    whole: str = "groups"
    """What each rank must hold whole: "blocks" (GGUF) or "groups" (AWQ, GPTQ)."""
    pack: int = 1
    """How many output features one stored word packs: a column-parallel rank's output features fill whole words."""
    refusal: str | None = None
    """Why this checkpoint cannot be split at all, whatever the sizes (None: it can, given the alignment)."""


def _no_alignment(quant_config: Mapping[str, Any]) -> SliceAlignment:
    """A scale per tensor or per output row (fp8): nothing to align."""
    return SliceAlignment()


def _gguf_alignment(quant_config: Mapping[str, Any]) -> SliceAlignment:
    """Whole blocks of the row-parallel tensors' type, recorded by vx.models.gguf as `row_parallel_block` (a config
    directory written before it holds that is checked against GGUF's smallest block; a K-quant tensor a rank would
    cut mid-block is then refused by the layer as it loads)."""
    block = int(quant_config.get("row_parallel_block", GGUF_MIN_BLOCK))
    return SliceAlignment(block, f"GGUF file's block of {block} weights (of its o_proj/down_proj tensors' types)",
                          "blocks")


def _awq_alignment(quant_config: Mapping[str, Any]) -> SliceAlignment:
    """Whole groups along K; 8 output features packed a word."""
    group = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
    if group == -1:
        return SliceAlignment(_INT4_KERNEL_GROUP, f"{_INT4_KERNEL_GROUP}-feature group of the 4-bit kernel", pack=8)
    return SliceAlignment(group, f"AWQ group_size of {group}", pack=8)


def _gptq_alignment(quant_config: Mapping[str, Any]) -> SliceAlignment:
    """Whole groups along K; the zeros pack 32 / bits output features a word; not with activation order."""
    bits = int(quant_config.get("bits", 4))
    group = int(quant_config.get("group_size", 128))
    pack = 32 // bits
    if quant_config.get("desc_act") and group != -1:
        return SliceAlignment(refusal="a GPTQ checkpoint with desc_act (activation order) puts a rank's input "
                                      "features in any group; vx splits GPTQ only without desc_act.")
    if group == -1:
        align = _INT4_KERNEL_GROUP if bits == 4 else pack
        return SliceAlignment(align, f"{align}-feature unit of GPTQ {bits}-bit (one group per row)", pack=pack)
    return SliceAlignment(group, f"GPTQ group_size of {group}", pack=pack)


@dataclass(frozen=True)
class QuantizationMethod:
    """One quantization method: its name, its `QuantizationConfig` class, and how its weights split over
    tensor-parallel ranks."""

    name: str
    """What `quantization=` and a checkpoint's `quant_method` say; the config class's `name`."""
    config_class: str
    """Its `QuantizationConfig` subclass as "module:Class", imported only when a model uses the method."""
    splits: bool = False
    """Whether its weights split over tensor-parallel ranks (else a model with it needs tensor_parallel_size=1)."""
    not_split_reason: str = ""
    """Why its weights do not split (when `splits` is False), for the error message."""
    alignment: Callable[[Mapping[str, Any]], SliceAlignment] = _no_alignment
    """What a rank's slice must align to, read from the checkpoint's `quantization_config` (when `splits`)."""
    cpu_kernels: str | None = "quant_matmul"
    """The module of `vx.kernels` whose C libraries its weights multiply through on the CPU (None: torch's ops)."""


METHODS: tuple[QuantizationMethod, ...] = (
    # GGUF files, their tensors as they are.
    QuantizationMethod("gguf", "vx.models.layers.quantization.gguf:GGUFConfig", splits=True,
                       alignment=_gguf_alignment, cpu_kernels="gguf_matmul"),
    # Hugging Face quantized checkpoints, named by their quantization_config.quant_method.
    QuantizationMethod("awq", "vx.models.layers.quantization.awq:AWQConfig", splits=True, alignment=_awq_alignment),
    QuantizationMethod("gptq", "vx.models.layers.quantization.gptq:GPTQConfig", splits=True,
                       alignment=_gptq_alignment),
    QuantizationMethod("fp8", "vx.models.layers.quantization.fp8:Fp8Config", splits=True, cpu_kernels=None),
    # A float checkpoint quantized at load.
    QuantizationMethod("int8", "vx.models.layers.quantization.weight_only:Int8Config",
                       not_split_reason="its per-row scales would be taken over each rank's half of a row, a "
                                        "different model than TP=1"),
    QuantizationMethod("int4", "vx.models.layers.quantization.weight_only:Int4Config",
                       not_split_reason="quantizing at load is not split across ranks yet"),
)
"""Every quantization method, one row each."""

QUANTIZATION_NAMES: tuple[str, ...] = tuple(m.name for m in METHODS)
"""Every value `quantization=` accepts besides None (None: whatever the checkpoint says, else none)."""


def find_quantization_method(name: str) -> QuantizationMethod | None:
    """The row of method `name`; None when no row has that name."""
    return next((m for m in METHODS if m.name == name), None)


def quantization_method(name: str) -> QuantizationMethod:
    """The row of method `name`; `ValueError` naming the known ones otherwise."""
    method = find_quantization_method(name)
    if method is not None:
        return method
    raise ValueError(f"Quantization method {name!r} is not supported; supported: "
                     f"{', '.join(QUANTIZATION_NAMES) or 'none'}.")
