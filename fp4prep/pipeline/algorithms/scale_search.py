"""NVFP4 block scales searched on each block's outputs, before GPTQ rounds against them.

Max calibration gives each block of 16 weights the E4M3 scale that holds its largest value; a
finer one clips that value a little and puts the other fifteen on a finer grid, which often moves
the outputs less (AWQ's clipping search, ModelOpt's ``local_hessian`` calibration, AutoRound's
learned clipping do the same from their sides). Here each block tries its max-calibrated E4M3 code
and the three under it (down to about 0.8×), and keeps the one whose rounding to nearest moves the
block's part of the outputs least: ``e Hb eᵀ`` per row, ``e`` the block's
rounding error and ``Hb`` the block's 16 × 16 part of the inputs' Hessian (the exact output error
of that block alone). The chosen code is written back as the quantizer's block amax, which is
what the export turns into the stored scale, so GPTQ rounds on, and the checkpoint holds, the same
scales. Routed experts go through the same code, each on its own tokens' Hessian. An option of
the recipe's GPTQ step (``Gptq.nv_scales="search"``), off in the shipped NVFP4 recipe: over six
adapters it lowered KL on answers on three and raised it on three.
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats.numerics import E2M1_MAX, e2m1_round_magnitudes, nvfp4_scale_codes

# E4M3 codes tried under the max-calibrated one (three: down to about 0.8x its scale). On the dense
# demo in NVFP4 (KL on answers over 60 held-back conversations; max-calibrated scales: sentiment
# 0.0398, orders 0.0168, dates 0.0374): 3 under 0.0308, 0.0162, 0.0358; 6 under 0.0267, 0.0158,
# 0.0401 (dates' task 96% -> 90%); 1 and 12 under on sentiment 0.0505, 0.0345; never a coarser code
# (2 over as well: 0.0928 on sentiment).
BELOW = 3


ELEMENTS = 1 << 24  # weights searched at once: bounds the candidates' temporaries (~64 MiB each in FP32)


@torch.no_grad()
def search(weight: torch.Tensor, hessian: torch.Tensor, quantizer: Any, group: int, fp8_max: float) -> int:
    """Set ``quantizer``'s block amax (a static NVFP4 weight quantizer of ``weight``, float32
    ``[rows, columns]``) to each block's best E4M3 code on ``hessian`` (``XᵀX`` per token of the
    input, ``[columns, columns]``); returns how many blocks moved off their max-calibrated scale."""
    rows, columns = weight.shape
    blocks = columns // group
    amax = quantizer.amax.reshape(rows, blocks).float().to(weight.device)
    top = quantizer.global_amax.float().to(weight.device)
    unit = top / (E2M1_MAX * fp8_max)  # one E4M3 code's worth of scale is code × unit
    # The export's own arithmetic: the first code tried is the one max calibration's checkpoint holds.
    bits = nvfp4_scale_codes(amax, top, fp8_max).view(torch.uint8).to(torch.int16)
    h = hessian.to(weight.device).reshape(blocks, group, blocks, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    step = max(1, ELEMENTS // columns)
    best = torch.cat([
        _best_codes(weight[r : r + step].reshape(-1, blocks, group), h, bits[r : r + step], unit)
        for r in range(0, rows, step)
    ])
    # Blocks of zeros (amax 0) keep their scale; the export stores those as zeros whatever it is.
    best = torch.where(amax > 0, best, bits)
    chosen = best.to(torch.uint8).view(torch.float8_e4m3fn).float() * unit * E2M1_MAX
    quantizer.amax = torch.where(amax > 0, chosen, amax).reshape(quantizer.amax.shape).to(quantizer.amax.dtype)
    return int((best != bits).sum())


def _best_codes(w: torch.Tensor, h: torch.Tensor, bits: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Of each block's code (``bits``) and the ``BELOW`` under it, the one of least ``e Hb eᵀ``; a tie
    keeps the coarser (max calibration's first)."""
    best_bits, best_error = bits, torch.full(bits.shape, float("inf"), device=w.device)
    magnitude, sign = w.abs(), w.sign()
    for offset in range(0, -BELOW - 1, -1):
        candidate = (bits + offset).clamp(min=1)
        scale = (candidate.to(torch.uint8).view(torch.float8_e4m3fn).float() * unit).unsqueeze(-1)
        # What ``quantize_to_scales(w, scale) - w`` gives (every scale here is positive), in a third
        # of its passes over the weights.
        error = (e2m1_round_magnitudes(magnitude / scale) * scale - magnitude) * sign
        energy = torch.einsum("rbi,bij,rbj->rb", error, h, error)
        better = energy < best_error
        best_bits = torch.where(better, candidate, best_bits)
        best_error = torch.where(better, energy, best_error)
    return best_bits
