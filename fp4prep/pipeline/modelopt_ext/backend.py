"""A pure-torch fake-quant backend for ModelOpt, so NVFP4 and MXFP4 run without CUDA.

ModelOpt 0.47 fake-quantizes NVFP4/MXFP4 only with CUDA/Triton kernels. It lets a quantizer name a
registered functional backend instead (``QuantizerAttributeConfig.backend``); ``CpuBackend`` is one,
computing with ``formats.numerics``, the arithmetic the exported checkpoint holds. FP8 goes through
it too, so that its rounding is the export's (divide by ``amax / 448``), not the eager path's.

Input quantizers name another backend, ``InputBackend``: a layer's input is quantized as the serving
engine quantizes it (``formats.engine``), since no checkpoint stores activations and the engine's
arithmetic is the one that will run.

Backend objects belong to one run (``Session`` registers them and takes them away again): the input
backend keeps the last few quantizations it made, for the projections that read one input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..formats.engine import (
    fp8_experts,
    fp8_linear,
    fp8_per_token_activations,
    fp8_static_activations,
    mxfp4_activations,
    nvfp4_activations,
    nvfp4_global_scale_of,
)
from ..formats.numerics import E4M3_MAX, fp8_codes, fp8_fake_quant, mxfp4_fake_quant, nvfp4_fake_quant

if TYPE_CHECKING:
    from modelopt.torch.quantization.nn import TensorQuantizer

NAME = "fp4prep_cpu"
INPUTS = "fp4prep_engine_inputs"


def handles(num_bits: object) -> bool:
    """Whether quantizers of these ``num_bits`` (E2M1 or E4M3) can run on this backend."""
    return isinstance(num_bits, (tuple, list)) and tuple(num_bits) in ((2, 1), (4, 3))


class CpuBackend:
    """Weights (and any quantizer not an input's): the checkpoint's arithmetic."""

    def __call__(self, inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
        _check(quantizer)
        if tuple(quantizer.num_bits) == (4, 3):
            return fp8_fake_quant(inputs, _amax(getattr(quantizer, "_amax", None), inputs))
        block_size, scale_bits = _blocks(quantizer, inputs)
        if scale_bits == (8, 0):
            return mxfp4_fake_quant(inputs, block_size)
        return nvfp4_fake_quant(inputs, block_size, _amax(quantizer.amax, inputs))


class InputBackend:
    """Input quantizers: the engine's arithmetic, with a cache of the last few NVFP4 results."""

    def __init__(self) -> None:
        self.recent = _Recent()

    def __call__(self, inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
        _check(quantizer)
        if tuple(quantizer.num_bits) == (4, 3):
            amax = getattr(quantizer, "_amax", None)
            if amax is not None:  # static: the scale ModelOpt's export stores, amax / 448
                return fp8_static_activations(inputs, amax.to(inputs.device).float() / E4M3_MAX)
            # Dynamic (ModelOpt turns per-token block_sizes {-1: None} into an axis): per token.
            return fp8_per_token_activations(inputs)
        block_size, scale_bits = _blocks(quantizer, inputs)
        if scale_bits == (8, 0):
            # Only FlashInfer quantizes MXFP4 inputs in vLLM 0.33 (Blackwell), in blocks of 32.
            if block_size != 32:
                raise NotImplementedError(f"MXFP4 inputs come in blocks of 32, not {block_size}")
            return mxfp4_activations(inputs)
        global_scale = nvfp4_global_scale_of(_amax(quantizer.amax, inputs))
        return self.recent.get_or_make(inputs, block_size, global_scale)


def fp8_forward_of(module: torch.nn.Module) -> Callable[..., torch.Tensor] | None:
    """The engine's FP8 forward for ``module`` (given the module first), or None where it has none."""
    if is_fp8_gemm(module):
        return fp8_gemm_forward
    return fp8_experts_forward if is_fp8_experts(module) else None


def is_fp8_gemm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a quantized linear layer the engine computes with its FP8 product:
    E4M3 weights with one scale per output channel, E4M3 inputs quantized per token as they come."""
    weights, inputs = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
    if weights is None or inputs is None or not (weights.is_enabled and inputs.is_enabled):
        return False
    amax = getattr(weights, "_amax", None)
    return (
        tuple(weights.num_bits) == tuple(inputs.num_bits) == (4, 3)
        and amax is not None and amax.numel() > 1 and getattr(inputs, "_amax", None) is None
    )


def fp8_gemm_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    """A calibrated FP8 layer's output as the engine computes it from the checkpoint's codes
    (``formats.engine.fp8_linear``), for comparison with the independent reload bit for bit."""
    weight: torch.Tensor = module._parameters["weight"]  # the weight itself, not ModelOpt's fake-quantized view
    codes, scale = fp8_codes(weight, module.weight_quantizer._amax.to(weight.device))
    return fp8_linear(x, codes, scale, module.bias)


def is_fp8_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ModelOpt's quantized fused experts in FP8 with static inputs (routed
    experts in an FP8 checkpoint), which the engine computes with its FP8 product."""
    weights, inputs = getattr(module, "gate_up_proj_weight_quantizers", None), getattr(module, "gate_up_proj_input_quantizer", None)
    if not weights or inputs is None or not (weights[0].is_enabled and inputs.is_enabled):
        return False
    return tuple(weights[0].num_bits) == tuple(inputs.num_bits) == (4, 3) and getattr(inputs, "_amax", None) is not None


def fp8_experts_forward(module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Calibrated FP8 routed experts as the engine computes them from the checkpoint's codes
    (``formats.engine.fp8_experts``), for comparison with the independent reload bit for bit."""
    gate_up, down = module._parameters["gate_up_proj"], module._parameters["down_proj"]

    def codes(weight: torch.Tensor, quantizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_codes(weight, quantizer._amax.to(weight.device))

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        gate_up_codes, gate_up_scale = codes(gate_up[e], module.gate_up_proj_weight_quantizers[e])
        return (gate_up_codes, gate_up_scale, *codes(down[e], module.down_proj_weight_quantizers[e]))

    inputs = (module.gate_up_proj_input_quantizer, module.down_proj_input_quantizer)
    scales = (inputs[0]._amax.to(hidden.device).float() / E4M3_MAX, inputs[1]._amax.to(hidden.device).float() / E4M3_MAX)
    return fp8_experts(hidden, top_k_index, top_k_weights, module.act_fn, expert, gate_up.shape[0], scales)


def _amax(calibrated: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor:
    """The calibrated amax, or the tensor's own before calibration set one."""
    return (inputs.detach().abs().amax() if calibrated is None else calibrated).to(inputs.device)


def _check(quantizer: TensorQuantizer) -> None:
    if not handles(quantizer.num_bits):
        raise NotImplementedError(f"fp4prep's backends handle E2M1 block formats and E4M3, not num_bits={quantizer.num_bits}")


def _blocks(quantizer: TensorQuantizer, inputs: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    block_sizes = quantizer.block_sizes or {}
    block_size = block_sizes.get(-1) or block_sizes.get(inputs.dim() - 1)
    scale_bits = tuple(block_sizes.get("scale_bits") or ())
    if not block_size:
        raise NotImplementedError("fp4prep's backends handle E2M1 only in blocks")
    if scale_bits not in ((8, 0), (4, 3)):
        raise NotImplementedError(f"unsupported scale_bits={scale_bits} for fp4prep's backends")
    return int(block_size), scale_bits


class _Recent:
    """The last few NVFP4 input quantizations of CPU tensors, by the very tensor (unmodified since).

    Projections that read one input (q/k/v, gate/up) each quantize it, with the same global scale,
    as engines do once for the fused GEMM: the second and third time it is the same work, which on
    a CPU costs as much as the matmul."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: list[tuple[torch.Tensor, int, int, float, torch.Tensor]] = []

    def get_or_make(self, x: torch.Tensor, block_size: int, global_scale: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.requires_grad:
            return nvfp4_activations(x, global_scale, block_size)
        key = (x._version, block_size, float(global_scale))
        for tensor, *rest, out in self.entries:
            if tensor is x and tuple(rest) == key:
                return out
        out = nvfp4_activations(x, global_scale, block_size)
        self.entries = [(x, *key, out), *self.entries[: self.size - 1]]
        return out
