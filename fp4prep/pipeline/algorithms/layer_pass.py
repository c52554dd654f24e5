"""The recipe's steps on one decoder layer, as ModelOpt's layerwise calibration hands it over.

One pass of the layer's calibration inputs does everything the steps need: ModelOpt's max
calibration sets every quantizer's range while forward hooks gather the AWQ search's statistics
(each fold group's inputs, each routed expert's ``down_proj`` inputs) and GPTQ's Hessians, routed
experts' among them (per expert, from the tokens routed to it; experts beyond the first chunk that
fits the Hessian budget get one more pass each, with quantization off). The routed experts come
first: each expert's scale is searched and folded into its own ``up`` rows, then GPTQ rounds them
(the rest of the layer's folds do not touch them); then the search picks each dense group's scale,
the fold moves the scales into norms and projections, and GPTQ rounds the folded weights. What folding did to each
weight, how many expert projections GPTQ rounded and how far its rounding moved each group's
outputs (what ``mixed.select`` ranks) are kept per layer, on disk beside
ModelOpt's layer checkpoints, for the retention check, the report and a calibration that resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import PipelineError
from ..recipes import Recipe
from . import awq, expert_awq, fold, gptq
from .mixed import GroupError


class LayerPass:
    """Runs ``recipe``'s steps on the decoder layers ``layers`` (by identity: index and name prefix)."""

    # After the steps, one more pass of the layer's inputs measures what its quantization adds to
    # the residual stream (``layer_errors``): off unless asked for (benchmarks/mixed_precision.py).
    measure_layers = False

    def __init__(
        self, recipe: Recipe, layers: dict[int, tuple[int, str]], factors_dir: Path | None = None, tokens: int = 0
    ) -> None:
        self.awq, self.gptq = recipe.awq, recipe.gptq
        self.tokens = tokens  # calibration tokens each forward loop runs: what the search keeps of them
        self.layers = layers
        self.factors_dir = factors_dir
        self.factors: fold.Factors = {}
        # Per routed-expert module: [projections GPTQ rounded, projections that kept max calibration].
        self.experts: dict[str, list[int]] = {}
        self.errors: list[GroupError] = []  # GPTQ's rounding error per group of projections reading one input
        # Per layer prefix: [sum ||out_q - out||², sum ||out||², quantized weights], where measured.
        self.layer_errors: dict[str, list[float]] = {}
        if factors_dir is not None and factors_dir.is_dir():
            for path in sorted(factors_dir.glob("*.pt")):
                # Written by this pipeline into the job's own state directory, never user-supplied.
                self.factors.update(torch.load(path, weights_only=True))
            for path in sorted(factors_dir.glob("*.experts.json")):
                self.experts.update(json.loads(path.read_text()))
            for path in sorted(factors_dir.glob("*.errors.json")):
                self.errors += [GroupError.from_list(row) for row in json.loads(path.read_text())]

    @torch.no_grad()
    def __call__(self, layer: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None]) -> None:
        from modelopt.torch.quantization.model_calib import max_calibrate

        if id(layer) not in self.layers:
            raise PipelineError(f"{type(layer).__name__} is not a decoder layer of the model being calibrated")
        index, prefix = self.layers[id(layer)]
        keep = awq.keep_every(self.tokens, self.awq.scored_tokens) if self.awq else 1
        groups = awq.fold_groups(layer, keep) if self.awq else []
        handles = [
            module.register_forward_pre_hook(lambda _m, args, g=group: g.observe(args[0]))
            for group in groups
            for _, module in group.members[:1]  # members read the same input
        ]
        expert_groups = (
            expert_awq.ExpertGroups(layer, expert_awq.keep_every(layer, self.tokens, self.awq.scored_tokens))
            if self.awq and self.awq.routed_experts else None
        )
        hessians = gptq.Hessians(layer, self.gptq.hessian_stride) if self.gptq else None
        chunks = gptq.expert_chunks(layer, gptq.expert_hessian_bytes()) if self.gptq else []
        # Every token routed to an expert counts (an expert sees k/experts of them: no stride).
        experts = gptq.ExpertHessians(layer, 1, chunks[0]) if self.gptq and chunks else None
        try:
            max_calibrate(layer, forward_loop)
        finally:
            for handle in handles:
                handle.remove()
            for collector in (expert_groups, hessians, experts):
                if collector is not None:
                    collector.remove()
        factors: fold.Factors = {}
        if self.awq and expert_groups is not None and expert_groups.groups:
            factors = expert_awq.search_and_fold(expert_groups, self.awq.alpha_step, self.awq.scored_tokens, prefix)
        rounded: dict[str, list[int]] = {}
        if self.gptq and experts is not None:
            experts.fold(factors, prefix)
            rounded = self._round_experts(layer, forward_loop, experts, chunks[1:], prefix)
        if self.awq:
            searched = [g for g in groups if g.tokens > 0]  # an expert no token reached keeps max
            if searched:
                awq.search_and_apply(searched, self.awq.alpha_step, self.awq.scored_tokens)
            factors.update(fold.fold_layer(layer, prefix))
        errors: list[GroupError] = []
        if self.gptq and hessians is not None:
            errors = gptq.quantize_layer(
                layer, hessians, prefix, factors, self.gptq.damp, self.gptq.activation_order, self.gptq.mx_exponents, self.gptq.nv_scales
            )
        self._record(index, factors, rounded, errors)
        if self.measure_layers:
            self.layer_errors[prefix] = _layer_error(layer, forward_loop)

    def _round_experts(
        self,
        layer: torch.nn.Module,
        forward_loop: Callable[[torch.nn.Module], None],
        first: gptq.ExpertHessians,
        rest: list[range],
        prefix: str,
    ) -> dict[str, list[int]]:
        """GPTQ on the routed experts, chunk by chunk: the first chunk's Hessians came with the
        calibration pass; each other chunk's come from one more pass with every quantizer off (the
        same unquantized inputs: nothing in the layer has changed yet but experts already rounded
        and experts' folded scales, and an expert's inputs don't depend on the others')."""
        from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

        assert self.gptq is not None
        totals: dict[str, list[int]] = {}

        def add(counts: dict[str, list[int]]) -> None:
            for name, (done, kept) in counts.items():
                total = totals.setdefault(prefix + name, [0, 0])
                total[0] += done
                total[1] += kept

        add(gptq.quantize_experts(first, self.gptq.damp, self.gptq.activation_order, self.gptq.mx_exponents, self.gptq.nv_scales))
        for chunk in rest:
            collector = gptq.ExpertHessians(layer, 1, chunk)
            try:
                with set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*", "enable": False}]):
                    forward_loop(layer)
            finally:
                collector.remove()
            add(gptq.quantize_experts(collector, self.gptq.damp, self.gptq.activation_order, self.gptq.mx_exponents, self.gptq.nv_scales))
        return totals

    def _record(
        self, index: int, factors: fold.Factors, experts: dict[str, list[int]], errors: list[GroupError]
    ) -> None:
        self.factors.update(factors)
        self.experts.update(experts)
        self.errors += errors
        if self.factors_dir is not None:
            self.factors_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.factors_dir / f"{index}.tmp"
            torch.save(factors, tmp)
            os.replace(tmp, self.factors_dir / f"{index}.pt")
            tmp = self.factors_dir / f"{index}.experts.tmp"
            tmp.write_text(json.dumps(experts))
            os.replace(tmp, self.factors_dir / f"{index}.experts.json")
            tmp = self.factors_dir / f"{index}.errors.tmp"
            tmp.write_text(json.dumps([e.to_list() for e in errors]))
            os.replace(tmp, self.factors_dir / f"{index}.errors.json")


def _layer_error(layer: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None]) -> list[float]:
    """The layer's output on its calibration inputs, quantized against unquantized: the squared
    error it adds to the residual stream, the output's squared size, and its quantized weights."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.utils import is_quantized_linear

    sums = [0.0, 0.0]
    busy: list[int] = []  # the hook's own reference call is not measured again

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if busy:
            return
        busy.append(1)
        try:
            with set_quantizer_by_cfg_context(module, [{"quantizer_name": "*", "enable": False}]):
                reference = module(*args, **kwargs)
        finally:
            busy.clear()
        out = output[0] if isinstance(output, tuple) else output
        ref = reference[0] if isinstance(reference, tuple) else reference
        sums[0] += float((out.float() - ref.float()).square().sum())
        sums[1] += float(ref.float().square().sum())

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        forward_loop(layer)
    finally:
        handle.remove()
    modules: list[Any] = [m for m in layer.modules() if is_quantized_linear(m)]
    weights = sum(m.weight.numel() for m in modules if m.weight_quantizer.is_enabled)
    return [*sums, float(weights)]
