"""How the serving engine quantizes a quantized layer's input, step for step.

A checkpoint's weights are dequantized the same way by every consumer (ModelOpt's arithmetic, in
``numerics``). Activations are not stored: the engine quantizes them as they come, and the last bit
of that arithmetic decides the codes of about one element in a thousand (the order of a
reciprocal, where the block scale is rounded), which over a few dozen W4A4 layers moves the top
token as much as the quantization itself. So wherever fp4prep computes a quantized model's outputs
(calibration, the AWQ search's scores, the reload, parity and the gate), a layer's input goes
through these functions, which follow vLLM's reference arithmetic, the one its kernels implement:

- NVFP4: ``ref_nvfp4_quant_dequant`` (``ref_nvfp4_quant`` + dequantization) in
  ``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``, with the global scale
  vLLM derives from the checkpoint: ``1 / input_scale`` for ModelOpt's layout
  (``KNvfp4Dynamic.process`` in ``vllm/model_executor/layers/quantization/modelopt.py``), the
  stored ``input_global_scale`` as it is for compressed-tensors'
  (``compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py``);
- FP8 per token: ``QuantFP8.forward_native`` in
  ``vllm/model_executor/layers/quantization/input_quant_fp8.py``; and a dense FP8 layer's product
  itself (``fp8_linear``: the codes multiplied, both scales applied after), which
  ``vllm/model_executor/kernels/linear/scaled_mm/`` computes without dequantizing an operand;
- MXFP4 on Blackwell GPUs (compute capability 10 and up), where vLLM runs an MXFP4 checkpoint W4A4
  whatever its config says (``FlashInferMxFp4LinearKernel`` in
  ``vllm/model_executor/kernels/linear/mxfp4/flashinfer.py``): FlashInfer 0.7.2.post1's
  ``mxfp4_quantize(backend="cute-dsl")``, the kernel in ``flashinfer/quantization/kernels/mxfp4_quantize.py``
  with its helpers in ``quantization_cute_dsl_utils.py``. On other GPUs vLLM runs it weights-only
  (Marlin) and the input stays BF16.

``tests/pipeline/formats/test_engine_numerics.py`` holds vLLM's own outputs for the NVFP4 and FP8 functions
on random tensors (written by ``benchmarks/engine_check.py vectors`` with vLLM installed) and
requires equal values. FlashInfer's MXFP4 kernel runs only on a Blackwell GPU, so its function is
checked against the kernel's arithmetic case by case (each branch of its scale rounding).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from .compiled import compiled
from .numerics import E2M1_MAX, E4M3_MAX, NVFP4_GLOBAL, e2m1_round

VLLM_VERSION = "0.33.0"
FP8_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)  # vLLM's floor on a dynamic FP8 scale


def nvfp4_global_scale(input_scale: torch.Tensor) -> torch.Tensor:
    """The engine's global scale for an NVFP4 layer's input, from the ``input_scale`` ModelOpt's
    layout stores (the largest of a fused group's, which fp4prep's exports make equal)."""
    return (1.0 / input_scale.float().max()).to(torch.float32)


def nvfp4_global_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The same for an input quantizer's calibrated amax, through the ``input_scale`` its export
    will store (FP32 amax over 6 × 448, as ModelOpt's export computes it)."""
    return nvfp4_global_scale(amax.float() / NVFP4_GLOBAL)


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    # Zero gets 1 / 1e8 instead of a division by zero (vLLM's get_reciprocal).
    return 1.0 / (x + (x == 0) * 1e8)


@compiled(rows_vary=True)
def nvfp4_activations(x: torch.Tensor, global_scale: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """An NVFP4 layer's input as the engine quantizes and dequantizes it, in ``x``'s dtype.

    Per block of ``block_size``: the E4M3 scale ``global × amax / 6`` (not floored: a scale that
    rounds to zero zeroes its block), the values multiplied by the reciprocal of ``scale / global``
    (not divided), clamped to ±6 and rounded to E2M1 half to even, then times ``scale / global``.
    """
    global_scale = global_scale.float().reshape(())
    blocks = x.reshape(-1, x.shape[-1] // block_size, block_size)
    vec_max = blocks.abs().amax(dim=-1, keepdim=True).float()
    scale = global_scale * (vec_max * (1 / E2M1_MAX))
    scale = scale.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    output_scale = _safe_reciprocal(scale * _safe_reciprocal(global_scale))
    scaled = (blocks.float() * output_scale).clamp(-E2M1_MAX, E2M1_MAX)
    out = e2m1_round(scaled) * (scale / global_scale)
    return out.reshape(x.shape).to(x.dtype)


def fp8_per_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dynamic per-token FP8 layer's input as the engine quantizes it: scale ``amax / 448`` per
    token (floored at 1 / (448 × 512)), values times its reciprocal, E4M3. Returns the codes and the
    FP32 scales (one per row)."""
    x_max = x.abs().amax(dim=-1).unsqueeze(-1).float()
    scale = (x_max / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    return (x.float() * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_per_token_activations(x: torch.Tensor) -> torch.Tensor:
    """The same input dequantized, in ``x``'s dtype."""
    q, scale = fp8_per_token_codes(x)
    return (q.float() * scale).to(x.dtype)


def fp8_static_codes(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A static FP8 input (one stored ``input_scale``) as the engine quantizes it: values times the
    scale's reciprocal, E4M3 (``QuantFP8`` static, ``scaled_fp8_quant``). Returns the codes and the
    scale, a 0-d FP32 tensor."""
    scale = scale.float().reshape(())
    return (x.float() * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_static_activations(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same input dequantized, in ``x``'s dtype."""
    q, scale = fp8_static_codes(x, scale)
    return (q.float() * scale).to(x.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """An FP8 layer's product as the engine computes it: E4M3 ``weight`` codes (in any dtype that
    holds them) with one ``weight_scale`` per output channel or one for the tensor, the input
    quantized per token, or with the stored ``input_scale`` (static). The codes are multiplied with
    FP32 sums, then the input's and the weight's scales (and ``row_scale``, a routed expert's
    routing weight per row) applied to the sums and the result rounded once to ``x``'s dtype: vLLM's
    CUTLASS ``scaled_mm`` epilogue on GPUs, its CPU kernel (``ChannelWiseTorchFP8ScaledMMLinearKernel``:
    ``torch._scaled_mm`` of the codes, then ``output * x_scale * weight_scale.t()``), and its Triton
    fused-MoE kernel for routed experts (``accumulator * a_scale * b_scale``, times the routing
    weight in the second product). A product of two E4M3 codes is exact in FP32 and the demo's sums
    are too, so the order of summation does not show; dequantizing the operands first, to BF16 or
    even to FP32, rounds where the engine does not, which on the demo moved 1 to 1.5% of the top
    tokens on answers."""
    q, scale = fp8_per_token_codes(x) if input_scale is None else fp8_static_codes(x, input_scale)
    sums = q.reshape(-1, q.shape[-1]).float() @ weight.float().T
    out = sums * (scale.reshape(-1, 1) if input_scale is None else scale) * weight_scale.float().reshape(1, -1)
    if row_scale is not None:
        out = out * row_scale.float().reshape(-1, 1)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def fp8_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    count: int,
    input_scales: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A routed-experts layer in FP8 as the engine computes it, for transformers' experts forward:
    ``expert(e)`` gives expert ``e``'s gate/up codes and scale and its down codes and scale (one
    scale per tensor), asked only of experts that got rows; ``input_scales`` are the layer's static
    input scales of the two products. Each expert's first product is rounded to ``hidden``'s dtype,
    its activation computed there, and the second product carries the routing weight before its one
    rounding (``fp8_linear``); an expert's rows come by slot, then token, as transformers' loop takes
    them."""
    out = torch.zeros_like(hidden)
    for e in range(count):
        slot, rows = torch.where((top_k_index == e).T)
        if rows.numel() == 0:
            continue
        gate_up, gate_up_scale, down, down_scale = expert(e)
        gate, up = fp8_linear(hidden[rows], gate_up, gate_up_scale, input_scale=input_scales[0]).chunk(2, dim=-1)
        weights = top_k_weights[rows, slot]
        y = fp8_linear(act_fn(gate) * up, down, down_scale, input_scale=input_scales[1], row_scale=weights)
        out.index_add_(0, rows, y.to(out.dtype))
    return out


MXFP4_BLOCK = 32
ONE_SIXTH = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)  # FlashInfer: rcp.approx of 6


def _ue8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """FlashInfer's ``float_to_ue8m0_fast`` (``cvt`` to E8M0 rounding toward +inf), on float32 bits:
    the biased exponent, plus one where any mantissa bit is set (not for a subnormal at most half
    the smallest normal), at most 254; zero for zero."""
    bits = v.contiguous().view(torch.int32)
    exponent, mantissa = (bits >> 23) & 255, bits & 0x7FFFFF
    bump = (mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))
    return torch.where(v <= 0, 0, (exponent + bump.int()).clamp(max=254))


def _exponent_float(biased: torch.Tensor) -> torch.Tensor:
    """2 ** (biased - 127) for biased exponents 1..254, built from the bits (zero for 0)."""
    return (biased.int() << 23).view(torch.float32)


def mxfp4_activations(x: torch.Tensor) -> torch.Tensor:
    """An MXFP4 layer's input as vLLM on a Blackwell GPU quantizes and dequantizes it, in ``x``'s dtype.

    Per block of 32: ``amax × (1/6)`` rounded *up* to a power of two (the UE8M0 scale), the values
    multiplied by its exact inverse, rounded to E2M1 half to even with saturation at ±6, then times
    the scale. An all-zero block (scale code 0) stays zero. ModelOpt's MXFP4 weights differ in two
    places: ``ceil(log2(amax / 6))`` in floating point, and ties rounded down.
    """
    blocks = x.reshape(-1, x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True).float()
    code = _ue8m0_round_up(amax * ONE_SIXTH)
    # The kernel's inverse scale: 2 ** (127 - code), from the bits; 0 when the code is 0.
    inverse = torch.where(code == 0, 0.0, _exponent_float((254 - code).clamp(min=0)))
    values = e2m1_round(blocks.float() * inverse)
    out = values * _exponent_float(code)
    return out.reshape(x.shape).to(x.dtype)


# Projections an engine fuses into one layer, by their stored names' last part.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def engine_layers(quantized: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each stored quantized module, the stored modules vLLM builds its layer from: its fused
    group (q/k/v, gate/up), and for a routed expert's projection that group in every expert of the
    layer (one pass over the names)."""
    groups: dict[tuple[str, str], list[str]] = {}
    key_of: dict[str, tuple[str, str]] = {}
    for module in quantized:
        parent, _, leaf = module.rpartition(".")
        leaves = next((group for group in _FUSED if leaf in group), (leaf,))
        expert = _EXPERT.fullmatch(parent)
        key_of[module] = key = (expert.group(1) if expert else parent, leaves[0])
        groups.setdefault(key, []).append(module)
    return {module: tuple(sorted(groups[key])) for module, key in key_of.items()}


_EXPERT = re.compile(r"(.*\.experts)\.\d+")
