"""Mixed precision: the projections FP4 hurts most kept in FP8, within a share of the weights.

GPTQ knows, for each input it rounds against, how far the rounded projections' outputs moved:
``tr(ΔW H ΔWᵀ)`` against the outputs' own size ``tr(W H Wᵀ)``, summed over the projections that
read that input (q/k/v, gate/up: fused groups, which engines run in one format). ``select`` ranks
those groups by that relative output error and keeps the worst in FP8, largest error first, while
their weights fit the budget; a calibration with those modules in FP8 (E4M3 weights per output
channel, inputs per token as they come: ``FP8_PER_CHANNEL_PER_TOKEN``, one of the layer formats
vLLM's ModelOpt loader reads in a ``MIXED_PRECISION`` checkpoint) then leaves the rest of the
recipe as it was: the AWQ search and GPTQ run on E2M1 projections only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..formats import FORMATS, of_quantizer


@dataclass(frozen=True)
class GroupError:
    """One fused group's rounding error: what it moved its outputs by, against their size."""

    names: tuple[str, ...]  # full module names
    error: float  # tr(ΔW H ΔWᵀ), summed over the group
    reference: float  # tr(W H Wᵀ), summed over the group
    weights: int  # parameters

    @property
    def relative(self) -> float:
        return self.error / self.reference if self.reference > 0 else 0.0

    def to_list(self) -> list[Any]:
        return [list(self.names), self.error, self.reference, self.weights]

    @classmethod
    def from_list(cls, row: Sequence[Any]) -> GroupError:
        return cls(tuple(row[0]), float(row[1]), float(row[2]), int(row[3]))


def e2m1(module: Any) -> bool:
    """Whether a quantized module's weights are E2M1 (NVFP4, MXFP4): what AWQ and GPTQ work on."""
    quantizer = module.weight_quantizer
    fmt = of_quantizer(quantizer.num_bits, quantizer.block_sizes)
    return fmt is not None and fmt.e2m1


def output_error(weight: torch.Tensor, rounded: torch.Tensor, hessian: torch.Tensor) -> tuple[float, float]:
    """``tr(ΔW H ΔWᵀ)`` and ``tr(W H Wᵀ)`` of one projection (``H`` per token)."""
    h = hessian.to(weight.device, torch.float32)
    w = weight.float()
    delta = rounded.float() - w
    return float(((delta @ h) * delta).sum()), float(((w @ h) * w).sum())


def select(groups: Iterable[GroupError], share: float, total_weights: int) -> list[GroupError]:
    """The groups to keep in FP8: worst relative output error first, each while the chosen ones'
    weights stay within ``share`` of ``total_weights`` (a group that doesn't fit is passed over)."""
    budget = share * total_weights
    chosen, used = [], 0
    for group in sorted(groups, key=lambda g: g.relative, reverse=True):
        if group.relative <= 0 or used + group.weights > budget:
            continue
        chosen.append(group)
        used += group.weights
    return chosen


def fp8_entries(names: Iterable[str]) -> list[dict[str, Any]]:
    """ModelOpt config entries that make these modules fp4prep's FP8: per-channel weights, inputs
    quantized per token as they come."""
    import modelopt.torch.quantization as mtq

    preset = {e["quantizer_name"]: e["cfg"] for e in getattr(mtq, FORMATS["fp8"].modelopt_config)["quant_cfg"] if "cfg" in e}
    return [
        {"quantizer_name": f"{name}.{which}", "cfg": copy.deepcopy(preset["*" + which])}
        for name in names
        for which in ("weight_quantizer", "input_quantizer")
    ]
