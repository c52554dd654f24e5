"""NVFP4's block scales searched on each block's outputs: never worse than max calibration's, and
the best of the codes tried, read back from the amax written (what GPTQ and the export read)."""

from __future__ import annotations

import types

import pytest
import torch

from fp4prep.pipeline.algorithms import scale_search
from fp4prep.pipeline.formats import numerics

ROWS, COLUMNS, GROUP = 48, 128, 16


def problem() -> tuple[torch.Tensor, torch.Tensor, types.SimpleNamespace]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(ROWS, COLUMNS, generator=generator) * torch.rand(ROWS, 1, generator=generator)
    weight[:3, :GROUP] = 0  # blocks of zeros
    x = torch.randn(4096, COLUMNS, generator=generator) @ (torch.eye(COLUMNS) + 0.2 * torch.randn(COLUMNS, COLUMNS, generator=generator) / 8)
    x[:, :5] *= 10  # a few loud inputs
    amax = weight.abs().reshape(ROWS, COLUMNS // GROUP, GROUP).amax(-1)
    # What a static NVFP4 weight quantizer holds: its block amax and the tensor's global amax.
    quantizer = types.SimpleNamespace(amax=amax.reshape(-1, 1).clone(), global_amax=weight.abs().amax())
    return weight, x.T @ x / len(x), quantizer


def block_errors(weight: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each block's rounding error in the outputs it alone moves: ``e Hb eᵀ``, by row and block."""
    blocks = COLUMNS // GROUP
    w = weight.reshape(ROWS, blocks, GROUP)
    e = numerics.quantize_to_scales(w, steps.unsqueeze(-1)) - w
    h = torch.stack([hessian[b * GROUP : (b + 1) * GROUP, b * GROUP : (b + 1) * GROUP] for b in range(blocks)])
    return torch.einsum("rbi,bij,rbj->rb", e, h, e)


def steps_of(quantizer: types.SimpleNamespace) -> torch.Tensor:
    """The block steps the export stores for the quantizer's amax (its E4M3 codes times the global scale)."""
    return numerics.static_nvfp4_scales(quantizer.amax.reshape(ROWS, -1), quantizer.global_amax)


def test_each_block_gets_the_best_of_the_codes_tried_and_never_a_worse_one_than_max_calibration() -> None:
    weight, hessian, quantizer = problem()
    max_steps = steps_of(quantizer)
    zeros = quantizer.amax.reshape(ROWS, -1) == 0
    moved = scale_search.search(weight, hessian, quantizer, GROUP, numerics.E4M3_MAX)

    searched = steps_of(quantizer)
    before, after = block_errors(weight, hessian, max_steps), block_errors(weight, hessian, searched)
    assert torch.all(after <= before)
    assert float(after.sum()) < 0.8 * float(before.sum())  # clipping a little pays on most blocks
    assert moved == int((searched != max_steps).sum()) and moved > ROWS * COLUMNS // GROUP // 3
    # Every searched step is finer than or equal to max calibration's (none coarser: that lost on the demo).
    assert torch.all(searched <= max_steps)
    assert torch.all(quantizer.amax.reshape(ROWS, -1)[zeros] == 0)

    # Brute force over the same E4M3 codes: no candidate beats the one chosen for any block.
    unit = quantizer.global_amax / (numerics.E2M1_MAX * numerics.E4M3_MAX)
    codes = (max_steps / unit).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    for offset in range(-scale_search.BELOW, 1):
        candidate = (codes + offset).clamp(min=1).to(torch.uint8).view(torch.float8_e4m3fn).float() * unit
        assert torch.all((after <= block_errors(weight, hessian, candidate) + 1e-6) | zeros)


def test_a_weight_searched_a_few_rows_at_a_time_gets_the_same_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, hessian, whole = problem()
    chunked = types.SimpleNamespace(amax=whole.amax.clone(), global_amax=whole.global_amax)
    scale_search.search(weight, hessian, whole, GROUP, numerics.E4M3_MAX)
    monkeypatch.setattr(scale_search, "ELEMENTS", 5 * COLUMNS)  # 10 chunks, the last of 3 rows
    scale_search.search(weight, hessian, chunked, GROUP, numerics.E4M3_MAX)
    assert torch.equal(chunked.amax, whole.amax)


def test_where_no_finer_code_moves_the_outputs_less_the_checkpoint_holds_max_calibrations_steps() -> None:
    # A Hessian of zeros: every code ties, and a tie keeps the first code tried, which must be the
    # one the export computes from max calibration's amax (its own arithmetic, to the last bit).
    # Block maxima half-way between two codes are where two orders of the same arithmetic part.
    weight, hessian, quantizer = problem()
    codes = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    halfway = ((codes[1:] + codes[:-1]) / 2).repeat(ROWS * COLUMNS // GROUP // 125 + 1)[: ROWS * COLUMNS // GROUP]
    unit = quantizer.global_amax / (numerics.E2M1_MAX * numerics.E4M3_MAX)
    quantizer.amax = (halfway * unit * numerics.E2M1_MAX).reshape(-1, 1)
    max_steps = steps_of(quantizer)
    assert scale_search.search(weight, torch.zeros_like(hessian), quantizer, GROUP, numerics.E4M3_MAX) == 0
    assert torch.equal(steps_of(quantizer), max_steps)
