"""The formats' arithmetic in plain torch: E2M1 rounding, NVFP4 / MXFP4 / FP8 quantize-dequantize,
block scales, and the packed E2M1 bytes a checkpoint stores.

These reproduce ModelOpt's own ``NVFP4QTensor`` / ``MXFP4QTensor`` quantize-then-dequantize, which
is what an exported checkpoint holds, so the fake-quant model that is calibrated and measured is
the model the checkpoint describes. The independent reader dequantizes with the same functions.
"""

from __future__ import annotations

import torch

from .compiled import compiled

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GLOBAL = E2M1_MAX * E4M3_MAX  # 2688: a global amax is its FP32 scale times this


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


# E2M1's values and the points half-way between them, where ``|x|`` moves to the next value: at a
# tie, half to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), so the
# ties that round up sit one float under their half-way point.
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_HALFWAY = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_BOUNDS = torch.where(
    torch.tensor([False, True, False, True, False, True, False]), torch.nextafter(_HALFWAY, torch.zeros(7)), _HALFWAY
)


def e2m1_round_magnitudes(m: torch.Tensor) -> torch.Tensor:
    """``e2m1_round`` of a float32 tensor of values ``>= 0``, in two passes over it (a search among
    E2M1's seven half-way points and a table) instead of a dozen: for searches that round a
    tensor many times."""
    return _E2M1_VALUES.to(m.device)[torch.bucketize(m, _E2M1_BOUNDS.to(m.device))]


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


@compiled(rows_vary=True)
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
    if not quantize:
        return amax.float() / E2M1_MAX
    top = amax.float().amax() if global_amax is None else global_amax.float()
    return nvfp4_scale_codes(amax, top, fp8_max).float() * (top / (E2M1_MAX * fp8_max))


def nvfp4_scale_codes(amax: torch.Tensor, top: torch.Tensor, fp8_max: float = E4M3_MAX) -> torch.Tensor:
    """The E4M3 code the export stores for each block of a static NVFP4 quantizer (``amax`` per
    block, ``top`` the global amax): its step is the code times ``top / (6 * fp8_max)``. A block of
    zeros gets the code of ``top`` (its weights are zeros on any step)."""
    scale = amax.float() / E2M1_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (scale * fp8_max / (top.float() / E2M1_MAX)).clamp(min=2**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_to_scales(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` on the E2M1 grid of ``scale`` (broadcast); a zero or non-finite scale gives zero."""
    bad = (scale == 0) | ~torch.isfinite(scale)
    safe = torch.where(bad, torch.ones_like(scale), scale)
    return torch.where(bad, torch.zeros_like(x), e2m1_round(x.float() / safe) * safe)


@compiled
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


def mxfp4_exponents(x: torch.Tensor, block_size: int, nearest: bool = False) -> torch.Tensor:
    """Unbiased E8M0 exponents per block, floored at -127: ``ceil(log2(amax / 6))``, the smallest
    step that holds every value of the block; with ``nearest``, the block's largest value rounded
    to the nearest power of two (up from a mantissa of 1.75) less E2M1's 2, compressed-tensors'
    rule: a block whose largest value lies between 6 and 7 of the finer steps keeps the finer
    grid, the largest value saturating at 6 steps."""
    block_amax = _blocks(x, block_size).float().abs().amax(dim=-1)
    floor = torch.tensor(-127.0, device=x.device)
    if nearest:
        return torch.floor(torch.maximum(torch.log2(block_amax / 1.75), floor + 1)) - 1
    return torch.ceil(torch.maximum(torch.log2(block_amax / E2M1_MAX), floor))


def mxfp4_steps(x: torch.Tensor, block_size: int, rule: str = "ceil", energy: torch.Tensor | None = None) -> torch.Tensor:
    """Each block's MXFP4 step (a power of two per ``block_size`` values of a row): ``ceil``, the
    smallest that holds the whole block; ``nearest``, compressed-tensors' rule (``mxfp4_exponents``);
    ``best``, of the ceiling's step and the next finer one (the block's largest values saturating),
    the one whose rounding to nearest errs less, each column's squared error weighted by ``energy``
    (its input's: the Hessian's diagonal, so the one that moves the outputs less)."""
    if rule != "best":
        return torch.exp2(mxfp4_exponents(x, block_size, nearest=rule == "nearest"))
    coarse = torch.exp2(mxfp4_exponents(x, block_size))
    blocks = _blocks(x, block_size).float()
    weights = torch.ones(x.shape[-1], device=x.device) if energy is None else energy.float()
    weights = _blocks(weights, block_size)

    def error(step: torch.Tensor) -> torch.Tensor:
        return ((quantize_to_scales(blocks, step.unsqueeze(-1)) - blocks).square() * weights).sum(-1)

    return torch.where(error(coarse / 2) < error(coarse), coarse / 2, coarse)


@compiled(rows_vary=True)
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
    q, scale = fp8_codes(x, amax)
    return (q.float() * scale).to(x.dtype)


def fp8_codes(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 codes ModelOpt's export writes for ``x`` and their FP32 scale ``amax / 448``."""
    amax = amax.float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # One scale for the whole tensor (0-d): the export divides the weight cast to BF16 (it writes
    # BF16) and the division keeps BF16 (a 0-d float32 tensor does not promote a BF16 one), so the
    # quotient rounds to BF16, then to E4M3; where the model computes in FP32, the same.
    scaled = x.to(torch.bfloat16) / scale if scale.dim() == 0 else x.float() / scale
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


# --- the stored form -------------------------------------------------------------------------------

E2M1_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Both values of every packed byte: byte -> (value of the low nibble, value of the high nibble).
E2M1_PAIRS = torch.stack((E2M1_LUT.repeat(16), E2M1_LUT.repeat_interleave(16)), dim=-1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` (low nibble = even element) to float32 values ``[..., K]``."""
    return E2M1_PAIRS.to(packed.device)[packed.int()].reshape(*packed.shape[:-1], -1)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values ``[..., K]`` (on the grid: what ``e2m1_round`` gives) to uint8 ``[..., K/2]``,
    the low nibble the even element; the inverse of ``unpack_e2m1`` (a zero keeps its sign)."""
    mag = values.float().abs()
    # The grid's codes 0-7: steps of 0.5 up to 2, then 3, 4, 6 (codes 5, 6, 7).
    code = torch.where(mag <= 2, mag * 2, torch.where(mag <= 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    code = code | (torch.signbit(values.float()).to(torch.uint8) << 3)
    pairs = code.reshape(*values.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def scale_blocks(values: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each block of ``values`` (the last dimension, split in ``steps.shape[-1]`` blocks) times its step."""
    blocks = values.reshape(*steps.shape, -1)
    return (blocks * steps.unsqueeze(-1)).reshape(values.shape)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: float) -> torch.Tensor:
    # Scale times global first, as engines and ModelOpt do: the rounding order shows in BF16.
    steps = block_scale.float() * torch.tensor(global_scale, dtype=torch.float32)
    return scale_blocks(unpack_e2m1(packed), steps)


def dequantize_mxfp4(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    return scale_blocks(unpack_e2m1(packed), torch.exp2(exponents.float() - 127))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 weights times their per-output-channel scale."""
    return weight.float() * scale.float().reshape(-1, *([1] * (weight.dim() - 1)))
