"""AWQ's per-channel scales, searched on the checkpoint engines run, for ``fold`` to fold away.

AWQ moves a per-input-channel scale ``s`` from a projection's activations into its weights
(``x / s`` times ``W * s``), so that the channels that matter most quantize finely. Engines run
plain NVFP4 / MXFP4 and no such scale, so fp4prep folds it into whatever makes the projection's
input: the norm before q/k/v or gate/up (one scale for the whole group), or ``up_proj``'s rows
for ``down_proj``. Two things follow that ModelOpt's ``awq_lite`` does not know, and ``fold_awq``
(our calibration algorithm, registered with ModelOpt) does:

- **One scale per fold group.** ``awq_lite`` picks q, k and v their own scales; folding can only
  give them the average, which none of the three searches looked at. ``fold_awq`` searches one
  scale for the group, on the group's outputs together.
- **The loss of the model engines run.** ``awq_lite`` scores each candidate with the activations
  left unquantized (W4A16); with NVFP4 activations the scale also changes how each 16-value
  activation block rounds, and its global scale. ``fold_awq`` scores each candidate with weights
  and activations quantized as the checkpoint and the engine do (the fake-quant functions the
  independent reader is checked against), and keeps no scale at all where none beats that.

Each layer's scales are folded as soon as they are chosen, so the layer ModelOpt writes back is
plain, and with ``gptq`` GPTQ (``gptq.py``) then rounds the weights the checkpoint will hold
(folding after it would rescale rows GPTQ had already rounded), its Hessians gathered in the same
calibration pass as the search's statistics. ``awq=False`` skips the search: max calibration and
GPTQ alone, as the MXFP4 recipe runs. What folding did to each weight is recorded per layer
(``folding``), on disk beside ModelOpt's layer checkpoints, for the retention check.

Each expert's ``down_proj`` folds into its own ``up_proj``; routed experts' gate/up (their norm
feeds every expert) are max-calibrated, never searched. With ``fold_attention_output``, ``o_proj``'s
scale is searched too, tied across the query heads that share a key-value head, and goes to
``v_proj``'s rows. Runs per decoder layer inside ModelOpt's layerwise calibration, on the layer it
is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import fakequant
from .errors import PipelineError
from .fold import (
    HEAD_SOURCE,
    HEAD_TARGET,
    NORM_GROUPS,
    Factors,
    calibrate_weights,
    fold_layer,
    has_static_weight_scales,
    head_tie,
    row_target,
    tied,
)

logger = logging.getLogger(__name__)

METHOD = "fold_awq"


def register() -> None:
    """Make ``fold_awq`` one of ModelOpt's calibration algorithms (idempotent). Needed before a
    calibration that names it, and before restoring the state of a model calibrated with it."""
    from modelopt.torch.opt.config import ModeloptField
    from modelopt.torch.quantization.config import QuantizeAlgorithmConfig
    from modelopt.torch.quantization.mode import BaseCalibrateModeDescriptor, CalibrateModeRegistry

    if f"{METHOD}_calibrate" in CalibrateModeRegistry:
        return

    class FoldAwqConfig(QuantizeAlgorithmConfig):
        """``fold_awq``: AWQ scales searched on the quantized model, one per fold group."""

        method: Literal["fold_awq"] = ModeloptField("fold_awq")
        alpha_step: float = ModeloptField(
            default=0.25,
            gt=0.0,
            le=1.0,
            title="Step of the AWQ exponent searched from 0 to 1.",
            description="Candidates are s = act_scale**alpha / weight_scale**(1 - alpha), and no scale.",
        )
        fold_attention_output: bool = ModeloptField(
            default=False,
            title="Also search o_proj's scale, tied across query heads, and fold it into v_proj's rows.",
            description="Off by default: on the demo adapters it lowered o_proj's own error and raised the answers' KL.",
        )
        scored_tokens: int = ModeloptField(
            default=2048,
            gt=0,
            title="About how many calibration tokens each candidate is scored on.",
            description="Every n-th token of each batch, so that about this many are scored in all.",
        )
        gptq: bool = ModeloptField(
            default=False,
            title="Then GPTQ on the smoothed weights (NVFP4 needs static weight scales).",
            description="Each projection's rounding error spread over its later columns through the "
            "inverse Hessian of its unquantized inputs, as the AWQ scales left them.",
        )
        awq: bool = ModeloptField(default=True, title="Search AWQ scales (off: max calibration, then GPTQ alone).")
        hessian_stride: int = ModeloptField(
            default=1, gt=0, title="GPTQ's Hessians from every n-th calibration token of each batch."
        )
        gptq_damp: float = ModeloptField(
            default=0.01, gt=0.0, le=1.0, title="GPTQ's damping, a share of the Hessian's mean diagonal."
        )

    class FoldAwqModeDescriptor(BaseCalibrateModeDescriptor):
        @property
        def config_class(self) -> type[QuantizeAlgorithmConfig]:
            return FoldAwqConfig

        _calib_func = search

    CalibrateModeRegistry.register_mode(FoldAwqModeDescriptor)


# --- what folding did, per layer ------------------------------------------------------------------


@dataclass
class FoldRecord:
    """The layers of the model being calibrated and what folding did to their weights so far."""

    layers: dict[int, tuple[int, str]]  # id(decoder layer) -> (index, name prefix)
    directory: Path | None  # one file per folded layer, kept for a resumed calibration
    factors: Factors = field(default_factory=dict)

    def add(self, index: int, factors: Factors) -> None:
        self.factors.update(factors)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f"{index}.tmp"
            torch.save(factors, tmp)
            os.replace(tmp, self.directory / f"{index}.pt")


_records: list[FoldRecord] = []


@contextlib.contextmanager
def folding(model: torch.nn.Module, directory: Path | None = None) -> Iterator[FoldRecord]:
    """While ``model`` calibrates, ``fold_awq`` folds each layer's scales and records the factors
    here (and in ``directory``, where those of layers an earlier run finished are read back)."""
    from .streaming import decoder_layers

    layers_name, layers = decoder_layers(model)
    record = FoldRecord({id(layer): (i, f"{layers_name}.{i}.") for i, layer in enumerate(layers)}, directory)
    if directory is not None and directory.is_dir():
        for path in sorted(directory.glob("*.pt")):
            # Written by this pipeline into the job's own state directory, never user-supplied.
            record.factors.update(torch.load(path, weights_only=True))
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


def _fold(layer: torch.nn.Module) -> tuple[FoldRecord, str, Factors] | None:
    """Fold ``layer``'s scales if it is a decoder layer of a model calibrating inside ``folding``;
    its record, name prefix and what folding did to its weights. Elsewhere (a layer calibrated on
    its own) the scales stay as pre_quant_scales, for ``fold.fold_pre_quant_scales``."""
    record = next((r for r in reversed(_records) if id(layer) in r.layers), None)
    if record is None:
        return None
    prefix = record.layers[id(layer)][1]
    factors: Factors = {}
    fold_layer(layer, prefix, factors)
    return record, prefix, factors


# --- the search -------------------------------------------------------------------------------

def weight_scale(weights: list[torch.Tensor], block: int) -> torch.Tensor:
    """AWQ's per-input-channel weight statistic: each value relative to its block's largest,
    averaged over every output row of the group."""
    rows = torch.cat([w.float() for w in weights])
    blocks = rows.abs().reshape(rows.shape[0], -1, block)
    relative = blocks / (blocks.amax(dim=-1, keepdim=True) + torch.finfo(torch.float32).tiny)
    return relative.reshape(rows.shape).mean(0)


def awq_scale(act_scale: torch.Tensor, w_scale: torch.Tensor, alpha: float) -> torch.Tensor:
    """``act_scale**alpha / w_scale**(1 - alpha)``, clamped and centred on 1 (geometrically)."""
    s = (act_scale.pow(alpha) / (w_scale.pow(1 - alpha) + torch.finfo(torch.float32).tiny)).clamp(1e-4, 1e4)
    return s / (s.max() * s.min()).sqrt()


@dataclass
class _Group:
    """Projections that must share one input scale, and what the search learns about them."""

    members: list[tuple[str, Any]]
    fused: bool  # engines run the members as one GEMM with one weight global scale
    tie: tuple[int, int, int] | None = None  # the scale is shared by query heads (see ``head_tie``)
    abs_sum: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    tokens: int = 0
    # The group's inputs as the calibration pass saw them (quantizers off): what candidates are scored on.
    inputs: list[torch.Tensor] = field(default_factory=list)
    # candidate -> the per-channel scale; candidate -> summed squared output error
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)


    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        abs_sum, amax = x.float().abs().sum(0), x.float().abs().amax(0)
        self.abs_sum = abs_sum if self.abs_sum is None else self.abs_sum + abs_sum
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        self.tokens += x.shape[0]
        self.inputs.append(x)


def fold_groups(layer: torch.nn.Module, attention_output: bool = False) -> list[_Group]:
    """The groups of ``layer``'s quantized projections whose AWQ scale can be folded away."""
    from modelopt.torch.quantization.utils import is_quantized_linear

    def quantized(name: str) -> Any:
        try:
            module: Any = layer.get_submodule(name)
        except AttributeError:
            return None
        return module if is_quantized_linear(module) and module.weight_quantizer.is_enabled else None

    groups = []
    for _norm, names in NORM_GROUPS:
        members = [(n, quantized(n)) for n in names]
        if all(m is not None for _, m in members):
            groups.append(_Group(members, fused=True))
    for name, _module in layer.named_modules():
        target = row_target(name)
        if target is not None and quantized(name) is not None and quantized(target) is not None:
            groups.append(_Group([(name, quantized(name))], fused=False))
    tie = head_tie(layer) if attention_output else None
    if tie is not None and quantized(HEAD_SOURCE) is not None and quantized(HEAD_TARGET) is not None:
        groups.append(_Group([(HEAD_SOURCE, quantized(HEAD_SOURCE))], fused=False, tie=tie))
    return groups


@torch.no_grad()
def search(
    layer: torch.nn.Module,
    forward_loop: Callable[[torch.nn.Module], None],
    alpha_step: float = 0.25,
    scored_tokens: int = 2048,
    fold_attention_output: bool = False,
    gptq: bool = False,
    gptq_damp: float = 0.01,
    awq: bool = True,
    hessian_stride: int = 1,
    **unused: Any,
) -> None:
    """ModelOpt calibration function: max-calibrate ``layer``, then give each fold group the scale
    (one of AWQ's, or none) whose quantized outputs are closest to the unquantized ones, fold the
    scales, and with ``gptq`` round the folded layer's weights with GPTQ (``gptq.quantize_layer``).

    The statistics the candidates come from see every calibration token; the candidates are scored
    on about ``scored_tokens`` of them, evenly spread (every n-th token of each batch), which is
    what the search costs."""
    from modelopt.torch.quantization.model_calib import max_calibrate

    from . import gptq as gptq_mod

    groups = fold_groups(layer, attention_output=fold_attention_output) if awq else []
    handles = [
        module.register_forward_pre_hook(lambda _m, args, g=group: g.observe(args[0]))
        for group in groups
        for _, module in group.members[:1]  # members read the same input
    ]
    hessians = gptq_mod.Hessians(layer, hessian_stride) if gptq else None
    try:
        max_calibrate(layer, forward_loop)
    finally:
        for handle in handles:
            handle.remove()
        if hessians is not None:
            hessians.remove()
    groups = [g for g in groups if g.tokens > 0]  # an expert no token reached keeps max
    if groups:
        _search_and_apply(groups, alpha_step, scored_tokens)
    folded = _fold(layer)
    if hessians is not None:
        if folded is None:
            raise PipelineError(f"{METHOD} with gptq rounds the folded layer: calibrate inside awq.folding(model)")
        gptq_mod.quantize_layer(layer, hessians, folded[1], folded[2], gptq_damp)
    elif has_static_weight_scales(layer):
        # Scaling and folding changed the weights after max calibration fixed their scales.
        calibrate_weights(layer)
    if folded is not None:
        record, _prefix, factors = folded
        record.add(record.layers[id(layer)][0], factors)


def _search_and_apply(groups: list[_Group], alpha_step: float, scored_tokens: int) -> None:
    from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth

    alphas = [round(a, 6) for a in torch.arange(0, 1 + alpha_step / 2, alpha_step).tolist()]
    for group in groups:
        prepared = _prepare(group, alphas, scored_tokens)
        for x in group.inputs:
            _score(group, prepared, x)
        group.inputs.clear()
        del prepared

    for group in groups:
        best = min(group.losses, key=group.losses.__getitem__)
        logger.debug(
            "%s: %s (output error %.4g of max calibration's)",
            "+".join(n for n, _ in group.members),
            best,
            group.losses[best] / max(group.losses["none"], 1e-30),
        )
        if best == "none":
            continue
        scale = group.scales[best]
        for _, module in group.members:
            if module.input_quantizer.amax is not None:
                # The per-channel maxima ModelOpt re-derives the global amax from when scales change.
                module.input_quantizer._amax_for_smoothing = group.amax.cpu()  # type: ignore[union-attr]
            apply_pre_quant_scale_and_smooth(module, (1.0 / scale).to(module.weight.device))


@dataclass
class _Prepared:
    """A group's candidates, ready to score: per candidate ``1 / s``, the input's global amax after
    the scale and the members' quantized ``W * s``, stacked (one GEMM)."""

    weight: torch.Tensor  # the members' unquantized weights, stacked, in the inputs' dtype
    quantize_input: fakequant.Quantize | None
    stride: int  # every stride-th token of a batch is scored
    candidates: list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]]


def _prepare(group: _Group, alphas: list[float], scored_tokens: int) -> _Prepared:
    first = group.members[0][1]
    quantize_weight, block = fakequant.engine_quantize(first.weight_quantizer)
    quantize_input, _ = fakequant.engine_quantize(first.input_quantizer)
    assert quantize_weight is not None and group.abs_sum is not None and group.amax is not None
    # Scored in the dtype the layer computes in (BF16 on GPUs and CPUs that multiply it natively):
    # rounding the outputs there moves every candidate's error alike.
    dtype = group.inputs[0].dtype if group.inputs else torch.float32
    act = group.abs_sum / group.tokens
    weights = [m.weight.detach().float() for _, m in group.members]
    w_stat = weight_scale(weights, block)
    group.scales = {f"alpha {a:g}": awq_scale(act, w_stat, a) for a in alphas}
    if group.tie is not None:
        group.scales = {name: tied(scale, group.tie) for name, scale in group.scales.items()}
    group.scales = {"none": torch.ones_like(act)} | group.scales
    group.losses = dict.fromkeys(group.scales, 0.0)
    prepared = _Prepared(torch.cat(weights).to(dtype), quantize_input, max(1, group.tokens // scored_tokens), [])
    for name, scale in group.scales.items():
        scaled = [w * scale for w in weights]
        tops = [w.abs().amax() for w in scaled]
        if group.fused:  # one GEMM in the engine, one weight global scale: the largest
            tops = [torch.stack(tops).amax()] * len(tops)
        input_amax = (group.amax / scale).amax() if quantize_input is not None else None
        if group.fused:  # block by block, so the stacked rows quantize as each member's would
            quantized = quantize_weight(torch.cat(scaled), tops[0]).to(dtype)
        else:
            quantized = torch.cat([quantize_weight(w, top) for w, top in zip(scaled, tops, strict=True)]).to(dtype)
        prepared.candidates.append((name, 1.0 / scale, input_amax, quantized))
    return prepared


def _score(group: _Group, prepared: _Prepared, x: torch.Tensor) -> None:
    """Add each candidate's squared error on the group's outputs for the batch ``x`` to its loss."""
    x = x[:: prepared.stride]
    if x.shape[0] == 0:
        return
    reference = x.to(prepared.weight.dtype) @ prepared.weight.T
    x = x.float()
    for name, inverse, input_amax, quantized in prepared.candidates:
        scaled = x * inverse
        if prepared.quantize_input is not None:
            scaled = prepared.quantize_input(scaled, input_amax)  # type: ignore[arg-type]
        error = scaled.to(quantized.dtype) @ quantized.T - reference
        group.losses[name] += float(error.float().pow(2).sum())
