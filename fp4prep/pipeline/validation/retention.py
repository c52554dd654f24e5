"""How much of the adapter's change survived quantization, tensor by tensor."""

from __future__ import annotations

import statistics

import torch

from ..algorithms.fold import Factors
from ..config import RetentionReport
from ..model.merge import MergedWeights
from .reader import DequantizedWeights


def _broadcast(scale: torch.Tensor, part: tuple[int, slice] | None, rows: bool) -> torch.Tensor:
    """A fold factor shaped to multiply the stored tensor: per column (``rows=False``) or per row of
    a 2-D weight; per expert ([experts, n]) for routed experts, sliced to the stored tensor's expert
    and rows where the checkpoint stores experts one by one, or whole for a fused 3-D tensor."""
    if scale.dim() == 2:
        if part is None:
            return scale[:, :, None] if rows else scale[:, None, :]
        expert, row_slice = part
        scale = scale[expert][row_slice] if rows else scale[expert]
    return scale.reshape(-1, 1) if rows else scale.reshape(1, -1)


def retention(
    merged: MergedWeights, dequantized: DequantizedWeights, factors: Factors | None = None
) -> RetentionReport | None:
    """Least-squares coefficient of (dequantized - base) on (merged - base), per changed tensor.

    About 1 when the adapter's change survived quantization, near 0 when it snapped back to the
    base (as it does when an adapter is merged into weights already in FP4). One tensor at a time.
    ``factors`` undoes what folding AWQ's scales did to a stored weight (``algorithms.fold``, and
    ``algorithms.expert_awq`` per routed expert).
    """
    per_tensor: dict[str, float] = {}
    num = den = 0.0
    model_name = merged.names.stored_of()
    for name in merged.targets():
        if not dequantized.holds_stored(name):
            continue
        b = merged.source.get(name, torch.float32, merged.device)
        delta = merged.merged(name, base=b).float() - b  # the base read once
        dd = float((delta * delta).sum())
        if dd == 0.0:
            continue
        stored = dequantized.stored(name).to(b.device, torch.float32)
        folded = (factors or {}).get(model_name.get(name, name), {})
        part = merged.names.expert_part(name) if folded else None
        if "in_scale" in folded:
            stored = stored * _broadcast(folded["in_scale"], part, rows=False).to(b.device)
        if "out_scale" in folded:
            stored = stored / _broadcast(folded["out_scale"], part, rows=True).to(b.device)
        change = stored - b
        dc = float((delta * change).sum())
        per_tensor[name] = dc / dd
        num += dc
        den += dd
    if not per_tensor:
        return None
    values = list(per_tensor.values())
    return RetentionReport(
        pooled=num / den, minimum=min(values), median=statistics.median(values), per_tensor=per_tensor
    )
