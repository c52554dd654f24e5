"""The recipe's steps on one decoder layer, as ModelOpt's layerwise calibration hands it over.

One pass of the layer's calibration inputs does everything the steps need: ModelOpt's max
calibration sets every quantizer's range while forward hooks gather the AWQ search's statistics
(each fold group's inputs) and GPTQ's Hessians. Then the search picks each group's scale, the fold
moves the scales into norms and projections, and GPTQ rounds the folded weights. What folding did
to each weight is kept per layer, on disk beside ModelOpt's layer checkpoints, for the retention
check and for a calibration that resumes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import PipelineError
from ..recipes import Recipe
from . import awq, fold, gptq


class LayerPass:
    """Runs ``recipe``'s steps on the decoder layers ``layers`` (by identity: index and name prefix)."""

    def __init__(self, recipe: Recipe, layers: dict[int, tuple[int, str]], factors_dir: Path | None = None) -> None:
        self.awq, self.gptq = recipe.awq, recipe.gptq
        self.layers = layers
        self.factors_dir = factors_dir
        self.factors: fold.Factors = {}
        if factors_dir is not None and factors_dir.is_dir():
            for path in sorted(factors_dir.glob("*.pt")):
                # Written by this pipeline into the job's own state directory, never user-supplied.
                self.factors.update(torch.load(path, weights_only=True))

    @torch.no_grad()
    def __call__(self, layer: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None]) -> None:
        from modelopt.torch.quantization.model_calib import max_calibrate

        if id(layer) not in self.layers:
            raise PipelineError(f"{type(layer).__name__} is not a decoder layer of the model being calibrated")
        index, prefix = self.layers[id(layer)]
        groups = awq.fold_groups(layer) if self.awq else []
        handles = [
            module.register_forward_pre_hook(lambda _m, args, g=group: g.observe(args[0]))
            for group in groups
            for _, module in group.members[:1]  # members read the same input
        ]
        hessians = gptq.Hessians(layer, self.gptq.hessian_stride) if self.gptq else None
        try:
            max_calibrate(layer, forward_loop)
        finally:
            for handle in handles:
                handle.remove()
            if hessians is not None:
                hessians.remove()
        factors: fold.Factors = {}
        if self.awq:
            searched = [g for g in groups if g.tokens > 0]  # an expert no token reached keeps max
            if searched:
                awq.search_and_apply(searched, self.awq.alpha_step, self.awq.scored_tokens)
            factors = fold.fold_layer(layer, prefix)
        if self.gptq and hessians is not None:
            gptq.quantize_layer(layer, hessians, prefix, factors, self.gptq.damp)
        self._record(index, factors)

    def _record(self, index: int, factors: fold.Factors) -> None:
        self.factors.update(factors)
        if self.factors_dir is not None:
            self.factors_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.factors_dir / f"{index}.tmp"
            torch.save(factors, tmp)
            os.replace(tmp, self.factors_dir / f"{index}.pt")
