"""The output formats, one ``Format`` each: everything that differs between NVFP4, MXFP4 and FP8.

A format says which ModelOpt preset quantizes to it, how its weights are stored (bits, block size,
block scales) and laid out on disk, whether engines quantize activations too, what the checkpoint
declares, and how large a checkpoint of it is. Which tensors stay BF16 is the same in every format
(``stays_bf16``). The arithmetic itself (E2M1 rounding, block scales, packing) is in ``numerics``.

Torch-free: the service reads the choices and sizes without importing the pipeline's libraries.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PipelineError, UserError

# Kept in BF16 in every format, by tensor or quantizer name (``<module>.<leaf>``): the output head,
# the embeddings and MoE routers. Norms are never Linear, so never quantized either.
KEPT_BF16 = ("*lm_head*", "*embed_tokens*", "*mlp.gate.*", "*block_sparse_moe.gate.*", "*router*", "*shared_expert_gate*")


def stays_bf16(name: str) -> bool:
    """Whether the tensor (or quantizer) ``name`` stays BF16 whatever the format."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in KEPT_BF16)


@dataclass(frozen=True)
class Layout:
    """How a checkpoint names a quantized module's tensors."""

    name: str  # "modelopt" (ModelOpt's unified HF export) or "compressed-tensors"
    packed_name: str  # the quantized weight's tensor: "weight" or "weight_packed"
    reciprocal_globals: bool  # global scales stored as divisors (compressed-tensors)


MODELOPT = Layout("modelopt", "weight", reciprocal_globals=False)
COMPRESSED_TENSORS = Layout("compressed-tensors", "weight_packed", reciprocal_globals=True)


@dataclass(frozen=True)
class Format:
    name: str
    modelopt_config: str  # ModelOpt's preset: an attribute of modelopt.torch.quantization
    modelopt_algo: str  # what ModelOpt's export declares (hf_quant_config's quant_algo)
    layout: Layout  # how fp4prep writes it: the layout vLLM's loader for this format takes
    ct_format: str | None  # compressed-tensors' name for it, where it has one
    bits: int  # per weight value: 4 (E2M1) or 8 (E4M3)
    block_size: int | None  # values sharing one block scale (None: a scale per output channel)
    block_scale: str | None  # the block scale's type: "e4m3" (times an FP32 global scale) or "e8m0"
    activations_quantized: bool  # engines quantize the inputs of quantized layers too
    # Routed experts get one weight scale per tensor and one static input scale, calibrated, instead
    # of the format's own: the only FP8 vLLM's ModelOpt MoE method loads (``ModelOptFp8MoEMethod``
    # reduces each expert projection's ``weight_scale`` to a scalar and reads ``input_scale``).
    per_tensor_experts: bool = False

    @property
    def declared(self) -> str:
        """What the written checkpoint declares itself to be."""
        return self.modelopt_algo if self.layout is MODELOPT else str(self.ct_format)

    @property
    def weight_bits(self) -> float:
        """Storage bits per quantized weight, block scales included."""
        return self.bits + (8 / self.block_size if self.block_size else 0)

    @property
    def e2m1(self) -> bool:
        return self.bits == 4

    def quantizes(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the stored tensor ``name`` of a model is quantized in this format: the 2-D weights
        of a decoder layer's projections (experts' too), not those that stay BF16."""
        return len(shape) == 2 and ".layers." in name and name.endswith(".weight") and not stays_bf16(name)

    def tensor_bytes(self, numel: int, quantized: bool) -> int:
        return int(numel * self.weight_bits / 8) if quantized else 2 * numel

    def checkpoint_bytes(self, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """About how large a checkpoint of the dense tensors ``shapes`` is in this format."""
        return sum(self.tensor_bytes(math.prod(shape), self.quantizes(name, shape)) for name, shape in shapes.items())


FORMATS: dict[str, Format] = {
    "nvfp4": Format(
        name="nvfp4",
        modelopt_config="NVFP4_DEFAULT_CFG",
        modelopt_algo="NVFP4",
        layout=MODELOPT,
        ct_format="nvfp4-pack-quantized",
        bits=4,
        block_size=16,
        block_scale="e4m3",
        activations_quantized=True,
    ),
    # Weights only, as MXFP4 releases ship (gpt-oss: E2M1 weights, BF16 activations); engines run
    # it as W4A16 MXFP4. Written in compressed-tensors' layout: vLLM's ModelOpt loader does not take
    # ModelOpt's own MXFP4 export.
    "mxfp4": Format(
        name="mxfp4",
        modelopt_config="MXFP4_DEFAULT_CFG",
        modelopt_algo="MXFP4",
        layout=COMPRESSED_TENSORS,
        ct_format="mxfp4-pack-quantized",
        bits=4,
        block_size=32,
        block_scale="e8m0",
        activations_quantized=False,
    ),
    "fp8": Format(
        name="fp8",
        modelopt_config="FP8_PER_CHANNEL_PER_TOKEN_CFG",
        modelopt_algo="FP8_PER_CHANNEL_PER_TOKEN",
        layout=MODELOPT,
        ct_format=None,
        bits=8,
        block_size=None,
        block_scale=None,
        activations_quantized=True,
        per_tensor_experts=True,
    ),
}

# Routed experts' quantizers, by name: per-expert modules (``mlp.experts.3.gate_proj``) and the
# fused expert tensors' (``mlp.experts.gate_up_proj_weight_quantizers.3``), never shared experts.
ROUTED_EXPERTS = "*.experts.*"


def get_format(name: str) -> Format:
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise UserError(f"unknown quantization {name!r}: choose one of {', '.join(FORMATS)}") from None


@dataclass(frozen=True)
class Declared:
    """What a checkpoint's config.json says it holds."""

    format: Format
    layout: Layout
    dynamic_inputs: bool  # activations quantized per token or block as they come, no stored scale


def declared(config: Mapping[str, Any]) -> Declared:
    """The format and layout ``config`` (a checkpoint's config.json) declares."""
    qc = config.get("quantization_config")
    if not qc:
        raise PipelineError("config.json declares no quantization_config")
    method = str(qc.get("quant_method", ""))
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "MIXED_PRECISION":
            fmt = _modelopt_format(algo)
            return Declared(fmt, MODELOPT, dynamic_inputs=fmt.name != "nvfp4")
        # Each layer declares its own: E2M1 layers (one format) and FP8 ones, per channel with
        # inputs per token as they come, or per tensor with a static input scale (routed experts).
        layers = qc.get("quantized_layers") or {}
        algos = {str(layer.get("quant_algo", "")).upper() for layer in layers.values() if isinstance(layer, dict)}
        e2m1 = {fmt.name: fmt for fmt in map(_modelopt_format, algos) if fmt.e2m1}
        if not algos or len(e2m1) > 1:
            raise PipelineError(f"the reader does not know a mixed-precision checkpoint of {sorted(algos) or 'no layers'}")
        fmt = next(iter(e2m1.values()), FORMATS["fp8"])
        return Declared(fmt, MODELOPT, dynamic_inputs=FORMATS["fp8"].modelopt_algo in algos)
    if method == "compressed-tensors":
        name = qc.get("format")
        group: dict[str, Any] = next(iter((qc.get("config_groups") or {}).values()), {})
        for fmt in FORMATS.values():
            if fmt.ct_format is not None and fmt.ct_format == name:
                dynamic = fmt.name == "mxfp4" and bool(group.get("input_activations"))
                return Declared(fmt, COMPRESSED_TENSORS, dynamic_inputs=dynamic)
        raise PipelineError(f"the reader does not know compressed-tensors' {name}")
    raise PipelineError(f"the reader does not know quant_method {method!r}")


def _modelopt_format(algo: str) -> Format:
    """The format of a ModelOpt ``quant_algo``; its per-tensor ``FP8`` (routed experts in an FP8
    checkpoint) is fp4prep's FP8 with one scale per tensor."""
    for fmt in FORMATS.values():
        if algo == fmt.modelopt_algo or (algo == "FP8" and fmt.bits == 8):
            return fmt
    raise PipelineError(f"the reader does not know ModelOpt's {algo}")


def of_quantizer(num_bits: Any, block_sizes: Mapping[Any, Any] | None) -> Format | None:
    """The format a ModelOpt quantizer with these settings computes, if it is one of ours."""
    bits = tuple(num_bits) if isinstance(num_bits, (tuple, list)) else None
    if bits == (4, 3):
        return FORMATS["fp8"]
    if bits != (2, 1):
        return None
    scale_bits = tuple((block_sizes or {}).get("scale_bits") or ())
    return {(4, 3): FORMATS["nvfp4"], (8, 0): FORMATS["mxfp4"]}.get(scale_bits)


def choices(bits: Iterable[int] = (4, 8)) -> list[str]:
    """The formats of these weight sizes, by name."""
    return [name for name, fmt in FORMATS.items() if fmt.bits in set(bits)]
