"""GPTQ's blockwise weight update on the CPU (and for MXFP4 on any device): the columns of a matrix
rounded in turn, each one's error spread over the columns after it through the inverse Hessian's
upper Cholesky factor; 16 columns, which share a block scale, in one step (``_round_group``)."""

from __future__ import annotations

import torch

from ..errors import PipelineError
from ..formats.compiled import Compiled
from ..formats.numerics import e2m1_round, quantize_to_scales

BLOCK = 128  # columns updated together before the rest of the matrix is corrected
CHUNK = 16  # columns rounded in one (compiled) step: within one block scale of NVFP4 or MXFP4


def gptq_update(weight: torch.Tensor, h_inv: torch.Tensor, scales: torch.Tensor, group: int, block_size: int) -> None:
    """GPTQ's blockwise weight update in place: each column rounded to the E2M1 grid of its block's
    scale (``scales``: one column per ``group`` weight columns, or one per weight column where the
    columns are rounded in another order than stored), its error spread over the columns after it
    through the inverse Hessian's upper Cholesky factor ``h_inv``."""
    columns = weight.shape[1]
    per_column = scales.shape[1] == columns
    if block_size % group or columns % group or group % CHUNK:
        raise PipelineError(f"GPTQ: {columns} columns in blocks of {block_size} can't be rounded in groups of {group}")
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = weight[:, start:end].clone()
        h_block = h_inv[start:end, start:end]
        errors = torch.empty_like(block)
        for first in range(0, end - start, CHUNK):
            last = first + CHUNK
            rounded, error = _round_group(
                block[:, first:last].contiguous(), h_block[first:last, first:last].contiguous(),
                (scales[:, start + first : start + last] if per_column else scales[:, (start + first) // group]).contiguous(),
            )
            block[:, first:last] = rounded
            errors[:, first:last] = error
            if last < end - start:
                block[:, last:].addmm_(error, h_block[first:last, last:], alpha=-1)
        weight[:, start:end] = block
        if end < columns:
            weight[:, end:].addmm_(errors, h_inv[start:end, end:], alpha=-1)


def _round_group_columns(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the columns of ``w`` in turn (on ``scale``: one per row, or one per row and column),
    each after the errors of the ones before it were spread into it; returns the rounded columns and
    the scaled errors. Written column by column, the form TorchInductor fuses into one loop over the
    rows (compiled in 10-20 s, 0.4 ms a group of 1,536 rows)."""
    columns = list(w.float().unbind(1))
    rounded, errors = [], []
    for i in range(len(columns)):
        q = quantize_to_scales(columns[i], scale[:, i] if scale.dim() == 2 else scale)
        error = (columns[i] - q) / h[i, i]
        for j in range(i + 1, len(columns)):
            columns[j] = columns[j] - error * h[i, j]
        rounded.append(q)
        errors.append(error)
    return torch.stack(rounded, 1), torch.stack(errors, 1)


def _round_group_eager(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_round_group_columns`` in the fewest operations, for eager torch, whose cost is their number,
    not their size (2.2 ms a group of 1,536 rows against 3.5): the scale's checks made once, and each
    column's error reaching the columns after it in one operation. The same values: each correction
    is still one product and one subtraction per value."""
    bad = (scale == 0) | ~torch.isfinite(scale)
    safe = torch.where(bad, torch.ones_like(scale), scale)
    rest = w.float().clone()
    rounded, errors = torch.empty_like(rest), torch.empty_like(rest)
    columns = rest.shape[1]
    for i in range(columns):
        column = rest[:, i]
        s, zero = (safe[:, i], bad[:, i]) if scale.dim() == 2 else (safe, bad)
        q = torch.where(zero, 0.0, e2m1_round(column / s) * s)
        error = (column - q) / h[i, i]
        if i + 1 < columns:
            rest[:, i + 1 :] -= error[:, None] * h[i, i + 1 :]
        rounded[:, i] = q
        errors[:, i] = error
    return rounded, errors


# Each row's chain is independent of the others: compiled, one loop over rows whatever its length,
# once a process has rounded enough groups in eager torch to have spent about what the compile costs
# (8,000 groups, ~20 s on a 2-core CPU: the dense demo's whole GPTQ stays eager). Matrices of fewer
# rows (tiny test models) stay eager. Both forms give the same values.
_round_group = Compiled(_round_group_columns, min_values=CHUNK * 512, compile_after=8_000, eager=_round_group_eager)
