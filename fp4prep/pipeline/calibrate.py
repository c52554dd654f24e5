"""Calibration: the recipe's quantizers inserted and calibrated, one decoder layer at a time.

ModelOpt's layerwise calibration runs the model's own forward with every decoder layer but one
replaced by a cheap placeholder, keeps the layer being calibrated materialized while it replays that
layer's captured inputs, and writes a per-layer checkpoint (quantizer state and the next layer's
inputs) so that a run that stops resumes from the last finished layer. On a streamed model that
means one layer's weights in memory at a time. Each layer gets max calibration and the recipe's
steps (``algorithms.layer_pass``).

MoE routers are watched meanwhile, so that every expert is known to have seen tokens before
anything is exported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .algorithms.fold import Factors
from .algorithms.layer_pass import LayerPass
from .algorithms.mixed import GroupError
from .device import Compute
from .errors import PipelineError
from .model.streaming import decoder_layers
from .modelopt_ext import quantizers
from .modelopt_ext.session import Session
from .recipes import Recipe
from .workdir import WorkDir

CALIBRATION_BATCH = 4


@dataclass
class Calibrated:
    """What calibration learned beside the quantizers' ranges."""

    expert_tokens: dict[str, list[int]]  # per MoE layer, the calibration tokens each expert got
    factors: Factors  # what folding did to each weight
    # Per routed-expert module: [projections GPTQ rounded, projections that kept max calibration].
    expert_gptq: dict[str, list[int]] = field(default_factory=dict)
    # GPTQ's rounding error per group of projections that read one input (``mixed.GroupError``).
    rounding_errors: list[GroupError] = field(default_factory=list)
    # Per decoder layer, where measured (``LayerPass.measure_layers``): what quantizing it adds to
    # the residual stream, its output's size and its quantized weights.
    layer_errors: dict[str, list[float]] = field(default_factory=dict)


def calibrate(
    model: torch.nn.Module,
    recipe: Recipe,
    sequences: list[list[int]],
    compute: Compute,
    session: Session,
    report: Callable[[float], None],
    work: WorkDir | None = None,
    before_layer: Callable[[torch.nn.Module], None] | None = None,
) -> Calibrated:
    """Insert the recipe's quantizers and calibrate them on ``sequences``, layer by layer.

    With ``work``, a calibration that stopped there earlier continues from its last finished layer.
    ``before_layer`` gets each decoder layer it calibrates first, its weights in place and unchanged
    (MoE routers are not counted there). Refuses if any MoE expert got no calibration token.
    """
    import modelopt.torch.quantization as mtq

    layers_name, layers = decoder_layers(model)
    batches = [
        torch.tensor(sequences[start : start + CALIBRATION_BATCH], dtype=torch.long)
        for start in range(0, len(sequences), CALIBRATION_BATCH)
    ]
    counter = ExpertCounter(model, len(batches), work.expert_tokens if work else None)
    start = work.resume_layer() if work else 0
    passes = []

    def forward_loop(m: torch.nn.Module) -> None:
        # ModelOpt calls this once per decoder layer, to capture that layer's inputs.
        passes.append(1)
        with torch.no_grad():
            for batch in batches:
                m(batch.to(compute.device), use_cache=False)
                report(min(1.0, (start + len(passes) - 1) / len(layers)))

    config = quantizers.quant_config(recipe, compute, work.layer_checkpoints if work else None)
    positions = {id(layer): (i, f"{layers_name}.{i}.") for i, layer in enumerate(layers)}
    tokens = sum(len(sequence) for sequence in sequences)
    layer_pass = LayerPass(recipe, positions, work.fold_factors if work else None, tokens)
    session.layer_pass = layer_pass
    if before_layer is not None:
        session.before_layer = lambda layer: counter.paused(before_layer, layer)
    try:
        with quantizers.quiet():
            mtq.quantize(model, config, forward_loop)
        if not passes and counter.counts:
            # A fully dynamic recipe (MXFP4 without steps) has no statistics to collect, so ModelOpt
            # skips the loop; for an MoE model the corpus still goes through once so that expert
            # coverage is known.
            forward_loop(model)
    finally:
        counter.remove()
        session.layer_pass = session.before_layer = None
    report(1.0)
    _check_coverage(counter)
    return Calibrated(counter.as_lists(), layer_pass.factors, layer_pass.experts, layer_pass.errors, layer_pass.layer_errors)


def _check_coverage(counter: ExpertCounter) -> None:
    uncovered = counter.uncovered()
    if uncovered:
        raise PipelineError(
            f"{len(uncovered)} MoE experts received no calibration tokens "
            f"({', '.join(uncovered[:4])}{', ...' if len(uncovered) > 4 else ''}); "
            "refusing to export uncalibrated experts: calibrate on a larger corpus"
        )


class ExpertCounter:
    """Counts, per MoE layer, the calibration tokens routed to each expert.

    Calibration may run a layer over the corpus more than once (GPTQ's further chunks of experts,
    ModelOpt's own capture of the next layer's inputs where it runs), so a layer's first pass,
    ``batches`` router calls, is counted and the rest ignored. Finished layers are written to
    ``path`` so a resumed run keeps the counts of the layers it does not run again.
    """

    def __init__(self, model: torch.nn.Module, batches: int, path: Path | None = None) -> None:
        self.batches = batches
        self.path = path
        self.counts: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self._handles = []
        self._counting = True
        saved = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        for name, module in model.named_modules():
            experts = getattr(module, "experts", None)
            gate = getattr(module, "gate", None)
            if experts is None or gate is None:
                continue
            n_experts = _expert_count(experts)
            if n_experts is None:
                continue
            if name in saved:
                self.counts[name] = torch.tensor(saved[name], dtype=torch.long)
                self.calls[name] = batches
            else:
                self.counts[name] = torch.zeros(n_experts, dtype=torch.long)
                self.calls[name] = 0
            self._handles.append(gate.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if not self._counting or self.calls[name] >= self.batches:
                return
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.dtype not in (torch.int64, torch.int32):
                return
            counts = self.counts[name]
            counts += torch.bincount(indices.reshape(-1).cpu(), minlength=len(counts))[: len(counts)]
            self.calls[name] += 1
            if self.calls[name] == self.batches:
                self._save()

        return hook

    def _save(self) -> None:
        if self.path is None:
            return
        done = {k: v.tolist() for k, v in self.counts.items() if self.calls[k] >= self.batches}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(done))
        os.replace(tmp, self.path)

    def paused(self, run: Callable[[torch.nn.Module], None], layer: torch.nn.Module) -> None:
        """``run(layer)`` with the routers' calls there not counted (not calibration's tokens)."""
        self._counting = False
        try:
            run(layer)
        finally:
            self._counting = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def as_lists(self) -> dict[str, list[int]]:
        return {k: v.tolist() for k, v in self.counts.items()}

    def uncovered(self) -> list[str]:
        return [
            f"{layer}.experts.{e}"
            for layer, counts in self.counts.items()
            for e in torch.nonzero(counts == 0).flatten().tolist()
        ]


def _expert_count(experts: torch.nn.Module) -> int | None:
    for attr in ("num_experts", "n_routed_experts"):
        if isinstance(getattr(experts, attr, None), int):
            return int(getattr(experts, attr))
    gate_up = getattr(experts, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3:
        return int(gate_up.shape[0])
    if isinstance(experts, torch.nn.ModuleList):
        return len(experts)
    return None
