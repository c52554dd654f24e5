"""A pure-torch fake-quant backend for ModelOpt, so NVFP4 and MXFP4 run without CUDA.

ModelOpt 0.47 fake-quantizes NVFP4/MXFP4 only with CUDA/Triton kernels. FP8 goes through it too, so
that its rounding is the export's (divide by ``amax / 448``), not the eager path's. It lets a quantizer name a
registered functional backend instead (``QuantizerAttributeConfig.backend``); this module provides
one that reproduces the numerics of ModelOpt's own ``NVFP4QTensor`` / ``MXFP4QTensor``
quantize-then-dequantize, which are what the exported checkpoint holds. So the fake-quant model we
calibrate and measure is the model the checkpoint describes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from modelopt.torch.quantization.nn import TensorQuantizer

BACKEND_NAME = "fp4prep_cpu"
Quantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (values, global amax) -> fake-quant

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., object])

E2M1_MAX = 6.0
E4M3_MAX = 448.0


def e2m1_round(x: torch.Tensor, ties_to_even: bool = True) -> torch.Tensor:
    """``x`` rounded to the nearest E2M1 value (saturating at 6), sign kept.

    Arithmetic instead of a table search: the grid's step is 0.5 below 2, 1 below 4, 2 up to 6,
    and dividing by a power of two is exact, so rounding ``|x| / step`` to an integer gives the
    same codes as ModelOpt's search. ``torch.round`` rounds half to even, as ``NVFP4QTensor``
    does; ``ceil(v - 0.5)`` rounds ties down, as ``MXFP4QTensor`` does.
    """
    mag = x.float().abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    units = mag / step
    units = torch.round(units) if ties_to_even else torch.ceil(units - 0.5)
    return torch.copysign(units * step, x.float())


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    if x.shape[-1] % block_size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block size {block_size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def nvfp4_scales(
    x: torch.Tensor, block_size: int, global_amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block E4M3 scales (as float32) and the FP32 global scale, as ``NVFP4QTensor`` makes them."""
    scale_2 = global_amax.float() / (E2M1_MAX * E4M3_MAX)
    block_amax = _blocks(x, block_size).abs().amax(dim=-1).float()
    per_block = block_amax / (E2M1_MAX * scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    per_block = per_block.clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return per_block, scale_2


def fused(fn: F, min_values: int | None = None) -> F:
    """``fn`` compiled by TorchInductor into one loop for CPU tensors, the eager ``fn`` elsewhere.

    In eager torch a quantize-dequantize is a dozen passes over the tensor and costs as much as the
    matmul it feeds; fused it is ~10x faster, with the same values (rounding, division and the
    E4M3 cast are elementwise and kept; the block maxima are exact whatever the order). Where
    compilation is unavailable (no C++ compiler) or ``FP4PREP_FUSED_QUANT=0``, the eager function
    runs, with a warning the first time. Tensors under ``min_values`` values (by default
    ``FUSED_MIN_VALUES``: decode steps, small models) stay eager.
    """
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args: object, **kwargs: object) -> Any:
        smallest = FUSED_MIN_VALUES if min_values is None else min_values
        if x.device.type != "cpu" or x.numel() < smallest or not _fusing[0]:
            return fn(x, *args, **kwargs)
        if not compiled:
            import torch._inductor.config

            # Compiled in this process: no pool of compiler processes beside a busy worker.
            torch._inductor.config.compile_threads = 1
            compiled.append(torch.compile(fn, dynamic=True))  # type: ignore[arg-type]
        try:
            return compiled[0](x, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager path is correct
            _fusing[0] = False
            logger.warning("fused fake quantization unavailable (%s); running it in eager torch", exc)
            return fn(x, *args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


_fusing = [os.environ.get("FP4PREP_FUSED_QUANT", "1") != "0"]
# Below this many values eager torch takes a few milliseconds at most: not worth a compile (which a
# fresh worker process pays again, from the on-disk cache, for every shape family it meets).
FUSED_MIN_VALUES = 1 << 18


@fused
def nvfp4_fake_quant(x: torch.Tensor, block_size: int, global_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize: E2M1 values, E4M3 scale per block, FP32 global scale."""
    per_block, scale_2 = nvfp4_scales(x, block_size, global_amax)
    step = (per_block * scale_2).unsqueeze(-1)
    blocks = _blocks(x, block_size)
    out = e2m1_round(blocks / step, ties_to_even=True) * step
    return out.reshape(x.shape).to(x.dtype)


def static_nvfp4_scales(
    amax: torch.Tensor, global_amax: torch.Tensor | None, quantize: bool = True, fp8_max: float = E4M3_MAX
) -> torch.Tensor:
    """The block steps of a static NVFP4 quantizer (per-block amax fixed by calibration: MSE,
    local Hessian, GPTQ, 4/6), as the exported checkpoint holds them and engines apply them: an
    E4M3 code per block, ``amax / 6`` normalized against the global amax (to 256 instead of 448
    in 4/6 mode), times the FP32 global scale ``global_amax / (6 * fp8_max)``.

    ModelOpt's Triton kernel rounds the same codes but forms the product in another order, which
    shows in the last bit of BF16 results; the checkpoint's order is the one that counts.
    """
    scale = amax.float() / E2M1_MAX
    if not quantize:
        return scale
    top = amax.float().amax() if global_amax is None else global_amax.float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    code = (scale * fp8_max / (top / E2M1_MAX)).clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return code * (top / (E2M1_MAX * fp8_max))


def quantize_to_scales(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` on the E2M1 grid of ``scale`` (broadcast); a zero or non-finite scale gives zero."""
    bad = (scale == 0) | ~torch.isfinite(scale)
    safe = torch.where(bad, torch.ones_like(scale), scale)
    return torch.where(bad, torch.zeros_like(x), e2m1_round(x.float() / safe) * safe)


@fused
def static_nvfp4_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
    pass_through_bwd: bool = False,
) -> torch.Tensor:
    """ModelOpt's ``static_blockwise_fp4_fake_quant`` (a Triton kernel) in torch, same signature."""
    scale = static_nvfp4_scales(amax, global_amax, quantize_block_scales, fp8_max_for_normalization)
    blocks = x.reshape(amax.numel(), -1).float()
    out = quantize_to_scales(blocks, scale.reshape(-1, 1).to(blocks.device))
    return out.reshape(x.shape).to(out_dtype or x.dtype)


def mxfp4_exponents(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Unbiased E8M0 exponents per block: ``ceil(log2(amax / 6))``, floored at -127."""
    block_amax = _blocks(x, block_size).float().abs().amax(dim=-1)
    floor = torch.tensor(-127.0, device=x.device)
    return torch.ceil(torch.maximum(torch.log2(block_amax / E2M1_MAX), floor))


@fused
def mxfp4_fake_quant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """MXFP4 quantize-dequantize: E2M1 values with a power-of-two (E8M0) scale per block."""
    step = torch.exp2(mxfp4_exponents(x, block_size)).unsqueeze(-1)
    blocks = _blocks(x, block_size).float()
    out = e2m1_round(blocks / step, ties_to_even=False) * step
    return out.reshape(x.shape).to(x.dtype)


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 quantize-dequantize with scale ``amax / 448`` (broadcast: per tensor, channel or token).

    The division by the scale, not a multiplication by its inverse, is what ModelOpt's export
    writes and what engines undo with ``fp8 * scale``; the difference shows in BF16.
    """
    amax = amax.float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def per_token_fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8, as engines quantize activations for FP8_PER_CHANNEL_PER_TOKEN."""
    return fp8_fake_quant(x, x.detach().abs().amax(dim=-1, keepdim=True))


def fake_quant(inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
    """The backend entry point ModelOpt calls from ``TensorQuantizer._fake_quantize``."""
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
        return _recent.get_or_make(inputs, block_size, amax.to(inputs.device))
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

    def clear(self) -> None:
        self.entries = []


_recent = _Recent()


def engine_quantize(quantizer: TensorQuantizer) -> tuple[Quantize | None, int]:
    """What an E2M1 block ``quantizer`` does to a tensor, in the checkpoint's arithmetic (dynamic
    per-block scales, the global amax given), and its block size; ``None`` when it is disabled
    (activations an engine leaves in BF16). For searches that try scales the quantizer has not
    been calibrated with."""
    from .errors import PipelineError

    block_sizes = dict(quantizer.block_sizes or {})
    block = int(block_sizes.get(-1) or 16)
    if not quantizer.is_enabled:
        return None, block
    scale_bits = tuple(block_sizes.get("scale_bits") or ())
    if tuple(quantizer.num_bits) != (2, 1) or scale_bits not in ((4, 3), (8, 0)):
        raise PipelineError(f"only E2M1 block formats can be searched, not num_bits={quantizer.num_bits} {block_sizes}")
    if scale_bits == (8, 0):
        return (lambda x, _amax: mxfp4_fake_quant(x, block)), block
    return (lambda x, amax: nvfp4_fake_quant(x, block, amax)), block


def handles(num_bits: object) -> bool:
    return tuple(num_bits) in ((2, 1), (4, 3)) if isinstance(num_bits, (tuple, list)) else False


def register() -> None:
    """Register the backend with ModelOpt (idempotent), with static NVFP4 fake quantization, which
    ModelOpt runs only as a Triton kernel (GPTQ's update, the other, is ``gptq.register``'s)."""
    from modelopt.torch.quantization.nn.modules import tensor_quantizer

    if not tensor_quantizer.is_registered_quant_backend(BACKEND_NAME):
        tensor_quantizer.register_quant_backend(BACKEND_NAME, fake_quant)
        _register_mse_sweep()
    # Static quantizers (promoted by MSE, local-Hessian and GPTQ calibration) call this kernel
    # directly, whatever their backend; without Triton (a CPU) it can't run.
    if not _triton_available():
        use_checkpoint_numerics_for_static_scales()


def use_checkpoint_numerics_for_static_scales() -> None:
    """Make static NVFP4 quantizers compute what the checkpoint holds (``static_nvfp4_fake_quant``)."""
    from modelopt.torch.quantization.nn.modules import tensor_quantizer

    tensor_quantizer.static_blockwise_fp4_fake_quant = static_nvfp4_fake_quant


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def _register_mse_sweep() -> None:
    """MSE's FP8 scale sweep picks ModelOpt's NVFP4 calibrator only for quantizers without a
    backend; ours asks for the same calibrator (it works through the quantizer, so through us)."""
    from modelopt.torch.quantization.calib import NVFP4MSECalibrator
    from modelopt.torch.quantization.model_calib import _register_fp8_sweep_calibrator

    def factory(amax: torch.Tensor, axis: object, quant_func: object) -> object:
        quantizer = quant_func.keywords["quantizer"]  # type: ignore[attr-defined]
        return NVFP4MSECalibrator(amax=amax, axis=axis, global_amax=quantizer.global_amax, quant_func=quant_func)

    _register_fp8_sweep_calibrator(BACKEND_NAME, factory)
