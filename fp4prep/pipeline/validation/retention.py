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


class Retention:
    """Least-squares coefficient of (dequantized - base) on (merged - base), per changed tensor.

    About 1 when the adapter's change survived quantization, near 0 when it snapped back to the
    base (as it does when an adapter is merged into weights already in FP4). One tensor at a time,
    as the BF16 merged model reads it (``observe``, given to ``MergedWeights.watch``: the base is
    then read once for both); ``report`` reads whatever was not observed. ``factors`` undoes what
    folding AWQ's scales did to a stored weight (``algorithms.fold``, and ``algorithms.expert_awq``
    per routed expert).
    """

    def __init__(self, merged: MergedWeights, dequantized: DequantizedWeights, factors: Factors | None = None) -> None:
        self.merged, self.dequantized, self.factors = merged, dequantized, factors or {}
        self.targets = set(merged.targets())
        self.per_tensor: dict[str, float] = {}
        self.seen: set[str] = set()
        self.num = self.den = 0.0
        self._model_name = merged.names.stored_of()

    def observe(self, name: str, base: torch.Tensor, merged: torch.Tensor) -> None:
        """Measure stored tensor ``name`` from its base and merged values (any dtype, any device)."""
        if name in self.seen or name not in self.targets or not self.dequantized.holds_stored(name):
            return
        self.seen.add(name)
        b = base.to(torch.float32)
        delta = merged.to(b.device, torch.float32) - b
        dd = float((delta * delta).sum())
        if dd == 0.0:
            return
        stored = self.dequantized.stored(name).to(b.device, torch.float32)
        folded = self.factors.get(self._model_name.get(name, name), {})
        part = self.merged.names.expert_part(name) if folded else None
        if "in_scale" in folded:
            stored = stored * _broadcast(folded["in_scale"], part, rows=False).to(b.device)
        if "out_scale" in folded:
            stored = stored / _broadcast(folded["out_scale"], part, rows=True).to(b.device)
        dc = float((delta * (stored - b)).sum())
        self.per_tensor[name] = dc / dd
        self.num += dc
        self.den += dd

    def report(self) -> RetentionReport | None:
        for name in sorted(self.targets - self.seen):
            base = self.merged.source.get(name, torch.float32, self.merged.device)
            self.observe(name, base, self.merged.merged(name, base=base))  # the base read once
        if not self.per_tensor:
            return None
        values = [self.per_tensor[name] for name in sorted(self.per_tensor)]
        return RetentionReport(
            pooled=self.num / self.den, minimum=min(values), median=statistics.median(values),
            per_tensor=dict(sorted(self.per_tensor.items())),
        )
