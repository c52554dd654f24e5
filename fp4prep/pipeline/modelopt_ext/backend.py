"""A pure-torch fake-quant backend for ModelOpt, so NVFP4 and MXFP4 run without CUDA.

ModelOpt 0.47 fake-quantizes NVFP4/MXFP4 only with CUDA/Triton kernels. It lets a quantizer name a
registered functional backend instead (``QuantizerAttributeConfig.backend``); ``CpuBackend`` is one,
computing with ``formats.numerics``, the arithmetic the exported checkpoint holds. FP8 goes through
it too, so that its rounding is the export's (divide by ``amax / 448``), not the eager path's.

A backend object belongs to one run (``Session`` registers it and takes it away again): it keeps the
last few quantizations it made, for the projections that read one input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..formats.numerics import fp8_fake_quant, mxfp4_fake_quant, nvfp4_fake_quant, per_token_fp8_fake_quant

if TYPE_CHECKING:
    from modelopt.torch.quantization.nn import TensorQuantizer

NAME = "fp4prep_cpu"


def handles(num_bits: object) -> bool:
    """Whether quantizers of these ``num_bits`` (E2M1 or E4M3) can run on this backend."""
    return isinstance(num_bits, (tuple, list)) and tuple(num_bits) in ((2, 1), (4, 3))


class CpuBackend:
    """The entry point ModelOpt calls from ``TensorQuantizer._fake_quantize``, with its cache."""

    def __init__(self) -> None:
        self.recent = _Recent()

    def __call__(self, inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
        block_sizes = quantizer.block_sizes or {}
        if not handles(quantizer.num_bits):
            raise NotImplementedError(
                f"the CPU backend handles E2M1 block formats and E4M3, not num_bits={quantizer.num_bits}"
            )
        if tuple(quantizer.num_bits) == (4, 3):
            amax = getattr(quantizer, "_amax", None)
            if amax is not None:
                return fp8_fake_quant(inputs, amax.to(inputs.device))
            if quantizer.axis is None and not block_sizes:
                return fp8_fake_quant(inputs, inputs.detach().abs().amax())
            # Dynamic with an axis (ModelOpt turns block_sizes {-1: None} into one): per token.
            return per_token_fp8_fake_quant(inputs)
        block_size = block_sizes.get(-1) or block_sizes.get(inputs.dim() - 1)
        scale_bits = tuple(block_sizes.get("scale_bits") or ())
        if not block_size:
            raise NotImplementedError("the CPU backend handles E2M1 only in blocks")
        if scale_bits == (8, 0):
            return mxfp4_fake_quant(inputs, block_size)
        if scale_bits == (4, 3):
            amax = quantizer.amax
            if amax is None:
                amax = inputs.detach().abs().amax()
            return self.recent.get_or_make(inputs, block_size, amax.to(inputs.device))
        raise NotImplementedError(f"unsupported scale_bits={scale_bits} for the CPU backend")


class _Recent:
    """The last few NVFP4 fake quantizations of CPU tensors, by the very tensor (unmodified since).

    Projections that read one input (q/k/v, gate/up) each quantize it, with the same global amax,
    as engines do once for the fused GEMM: the second and third time it is the same work, which on
    a CPU costs as much as the matmul."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.entries: list[tuple[torch.Tensor, int, int, float, torch.Tensor]] = []

    def get_or_make(self, x: torch.Tensor, block_size: int, amax: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or amax.numel() != 1 or x.requires_grad:
            return nvfp4_fake_quant(x, block_size, amax)
        key = (x._version, block_size, float(amax))
        for tensor, *rest, out in self.entries:
            if tensor is x and tuple(rest) == key:
                return out
        out = nvfp4_fake_quant(x, block_size, amax)
        self.entries = [(x, *key, out), *self.entries[: self.size - 1]]
        return out
