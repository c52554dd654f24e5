"""An independent reader of the checkpoints we write: our own decoding, not ModelOpt's.

It dequantizes the safetensors into a dense transformers model, one tensor at a time as each layer
runs, and, where the format quantizes activations, applies the same activation quantization a
serving engine applies (from the stored input scales). The model it returns computes what the
checkpoint describes, so its logits are compared with the calibrated fake-quant model's and, in
parity, with the BF16 model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch

from . import fakequant, streaming
from .checkpoint import TensorSource, read_config
from .device import Compute
from .errors import PipelineError
from .streaming import LazyWeights

E2M1_LUT = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
NVFP4_GLOBAL = fakequant.E2M1_MAX * fakequant.E4M3_MAX  # 2688: amax = scale * 2688


@dataclass
class Layout:
    """What a checkpoint declares: ``nvfp4``, ``mxfp4`` or ``fp8``, and how it names tensors."""

    scheme: str
    packed_name: str  # "weight" (ModelOpt) or "weight_packed" (compressed-tensors)
    reciprocal_globals: bool  # compressed-tensors stores global scales as divisors
    dynamic_inputs: bool


def detect_layout(config: dict[str, Any]) -> Layout:
    qc = config.get("quantization_config")
    if not qc:
        raise PipelineError("config.json declares no quantization_config")
    method = str(qc.get("quant_method", ""))
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo in ("NVFP4", "W4A16_NVFP4"):  # W4A16: the same weights, no input scales
            return Layout("nvfp4", "weight", False, False)
        if algo == "MXFP4":
            return Layout("mxfp4", "weight", False, True)
        if algo in ("FP8_PER_CHANNEL_PER_TOKEN", "FP8"):
            return Layout("fp8", "weight", False, algo == "FP8_PER_CHANNEL_PER_TOKEN")
        raise PipelineError(f"the reader does not know ModelOpt's {algo}")
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt == "nvfp4-pack-quantized":
            return Layout("nvfp4", "weight_packed", True, False)
        if fmt == "mxfp4-pack-quantized":
            group: dict[str, Any] = next(iter((qc.get("config_groups") or {}).values()), {})
            return Layout("mxfp4", "weight_packed", True, bool(group.get("input_activations")))
        raise PipelineError(f"the reader does not know compressed-tensors' {fmt}")
    raise PipelineError(f"the reader does not know quant_method {method!r}")


# Both values of every packed byte: byte -> (value of the low nibble, value of the high nibble).
E2M1_PAIRS = torch.stack((E2M1_LUT.repeat(16), E2M1_LUT.repeat_interleave(16)), dim=-1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` (low nibble = even element) to float32 values ``[..., K]``."""
    return E2M1_PAIRS.to(packed.device)[packed.int()].reshape(*packed.shape[:-1], -1)


def _scale_blocks(values: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each block of ``values`` (the last dimension, split in ``steps.shape[-1]`` blocks) times its step."""
    blocks = values.reshape(*steps.shape, -1)
    return (blocks * steps.unsqueeze(-1)).reshape(values.shape)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: float) -> torch.Tensor:
    # Scale times global first, as engines and ModelOpt do: the rounding order shows in BF16.
    steps = block_scale.float() * torch.tensor(global_scale, dtype=torch.float32)
    return _scale_blocks(unpack_e2m1(packed), steps)


def dequantize_mxfp4(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    return _scale_blocks(unpack_e2m1(packed), torch.exp2(exponents.float() - 127))


def _scalar(t: torch.Tensor) -> float:
    return float(t.float().reshape(-1)[0])


# An activation quantizer is a function applied to a Linear's input.
ActivationQuant = Callable[[torch.Tensor], torch.Tensor]


class DequantizedWeights(LazyWeights):
    """A quantized checkpoint's weights, dense, each dequantized when it is read.

    ``activations`` holds, per quantized module, the activation quantization a serving engine
    applies to its input (from the stored input scales).
    """

    def __init__(self, directory: Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        self.config = read_config(directory)
        self.format = detect_layout(self.config)
        self.source = TensorSource(directory)
        names = set(self.source.names())
        self.quantized = {n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")}
        dense = [n for n in sorted(names) if n.rpartition(".")[0] not in self.quantized]
        dense += [f"{m}.weight" for m in sorted(self.quantized)]
        super().__init__(dense, dtype, device)

    @cached_property
    def activations(self) -> dict[str, ActivationQuant]:
        names = set(self.source.names())
        return {m: q for m in sorted(self.quantized) if (q := self._activation_quant(m, names))}

    def stored_shape(self, name: str) -> tuple[int, ...]:
        module = name.rpartition(".")[0]
        if module not in self.quantized:
            return self.source.shape(name)
        shape = self.source.shape(f"{module}.{self.format.packed_name}")
        return shape if self.format.scheme == "fp8" else (*shape[:-1], shape[-1] * 2)

    def stored(self, name: str) -> torch.Tensor:
        module = name.rpartition(".")[0]
        if module not in self.quantized:
            return self.source.raw(name).to(self.device, self.dtype)
        layout, source = self.format, self.source
        packed = source.raw(f"{module}.{layout.packed_name}").to(self.device)
        scale = source.raw(f"{module}.weight_scale").to(self.device)
        if layout.scheme == "nvfp4":
            g_name = "weight_global_scale" if layout.reciprocal_globals else "weight_scale_2"
            g = _scalar(source.raw(f"{module}.{g_name}"))
            weight = dequantize_nvfp4(packed, scale, 1.0 / g if layout.reciprocal_globals else g)
        elif layout.scheme == "mxfp4":
            weight = dequantize_mxfp4(packed, scale)
        else:
            weight = packed.float() * scale.float().reshape(-1, *([1] * (packed.dim() - 1)))
        return weight.to(self.dtype)

    def _activation_quant(self, module: str, names: set[str]) -> ActivationQuant | None:
        layout, source = self.format, self.source
        if layout.scheme == "nvfp4":
            i_name = "input_global_scale" if layout.reciprocal_globals else "input_scale"
            if f"{module}.{i_name}" not in names:
                return None
            s = _scalar(source.raw(f"{module}.{i_name}"))
            amax = torch.tensor(NVFP4_GLOBAL / s if layout.reciprocal_globals else NVFP4_GLOBAL * s)
            return partial(fakequant.nvfp4_fake_quant, block_size=16, global_amax=amax)
        if layout.scheme == "mxfp4":
            return partial(fakequant.mxfp4_fake_quant, block_size=32) if layout.dynamic_inputs else None
        if layout.dynamic_inputs:
            return fakequant.per_token_fp8_fake_quant
        if f"{module}.input_scale" in names:
            amax = source.raw(f"{module}.input_scale").float() * fakequant.E4M3_MAX
            return partial(fakequant.fp8_fake_quant, amax=amax)
        return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _quantized_experts_forward(
    experts: Any, gate_up_quant: list[ActivationQuant], down_quant: list[ActivationQuant]
) -> Callable[..., torch.Tensor]:
    """transformers' fused-experts loop with each expert's input quantization, as engines run it."""

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = gate_up_quant[e](hidden[token_idx])
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = down_quant[e](experts.act_fn(gate) * up)
            y = torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


def load(directory: Path, compute: Compute, quantize_activations: bool = True) -> torch.nn.Module:
    """The checkpoint as a model that computes what a serving engine computes, one layer at a time."""
    weights = DequantizedWeights(directory, compute.dtype, compute.device)
    activations = weights.activations if quantize_activations else {}

    def engine_numerics(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if name in activations:
                module.register_forward_pre_hook(
                    lambda m, args, q=activations[name]: (q(args[0]),) + tuple(args[1:])
                )
            gate_up = getattr(module, "gate_up_proj", None)
            if activations and isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:
                n = gate_up.shape[0]
                gu = [activations.get(f"{name}.{e}.gate_proj", _identity) for e in range(n)]
                down = [activations.get(f"{name}.{e}.down_proj", _identity) for e in range(n)]
                module.forward = _quantized_experts_forward(module, gu, down)

    return streaming.build(weights.config, weights, compute, directory, before_hooks=engine_numerics)
