"""Rounding a weight the adapter changed onto the block scales its FP4 release fixes.

An adapter trained on an FP4 release was trained on the release's dequantized weights, which sit
exactly on the FP4 grid; its change is mostly smaller than half a step. Holding the release's block
scales keeps every weight the adapter does not change exactly as it ships (it is copied, not
requantized) and puts the changed ones on the same grid the engine reads.
"""

from __future__ import annotations

import torch

from ..formats.numerics import e2m1_round


def nearest(weight: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The E2M1 values nearest ``weight / step`` for each block (``steps``: one per block of the last
    dimension), ties to even, saturating at 6; a block whose step is zero or not finite gives zeros."""
    blocks = weight.float().reshape(*steps.shape, -1)
    step = steps.unsqueeze(-1)
    bad = (step == 0) | ~torch.isfinite(step)
    values = e2m1_round(blocks / torch.where(bad, torch.ones_like(step), step))
    return torch.where(bad, torch.zeros_like(values), values).reshape(weight.shape)
