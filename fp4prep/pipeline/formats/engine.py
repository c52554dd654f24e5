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
  ``vllm/model_executor/layers/quantization/input_quant_fp8.py``.

``tests/pipeline/test_engine_numerics.py`` holds vLLM's own outputs for these functions on random
tensors (written by ``benchmarks/engine_check.py --vectors`` with vLLM installed) and requires equal
values.
"""

from __future__ import annotations

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


@compiled
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


def fp8_per_token_activations(x: torch.Tensor) -> torch.Tensor:
    """A dynamic per-token FP8 layer's input as the engine quantizes and dequantizes it: scale
    ``amax / 448`` per token (floored at 1 / (448 × 512)), values times its reciprocal, E4M3."""
    x_max = x.abs().amax(dim=-1).unsqueeze(-1).float()
    scale = (x_max / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    q = (x.float() * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)
