"""AWQ's per-channel scales, searched on the checkpoint engines run, for ``fold`` to fold away.

AWQ moves a per-input-channel scale ``s`` from a projection's activations into its weights
(``x / s`` times ``W * s``), so that the channels that matter most quantize finely. Engines run
plain NVFP4 / MXFP4 and no such scale, so it is folded into whatever makes the projection's input:
the norm before q/k/v or gate/up (one scale for the whole group), or ``up_proj``'s rows for
``down_proj`` (``fold.py``). Two things follow that ModelOpt's ``awq_lite`` does not know:

- **One scale per fold group.** ``awq_lite`` picks q, k and v their own scales; folding can only
  give them the average, which none of the three searches looked at. Here one scale is searched
  for the group, on the group's outputs together.
- **The loss of the model engines run.** ``awq_lite`` scores each candidate with the activations
  left unquantized (W4A16); with NVFP4 activations the scale also changes how each 16-value
  activation block rounds, and its global scale. Here each candidate is scored with weights and
  activations quantized as the checkpoint and the engine do (the numerics the independent reader
  is checked against), and no scale at all is kept where none beats that.

A shared expert's ``down_proj`` folds into its own ``up_proj`` like a dense MLP's; routed experts,
which transformers stacks in one module per layer, are searched the same way per expert in
``expert_awq``. Plain per-layer maths: ``fold_groups``
finds a layer's groups, ``Group.observe`` gathers their inputs in the calibration pass, and
``search_and_apply`` gives each group its best scale as a ModelOpt ``pre_quant_scale``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PipelineError
from ..formats import of_quantizer
from ..formats.engine import nvfp4_activations, nvfp4_global_scale_of
from ..formats.numerics import mxfp4_fake_quant, nvfp4_fake_quant
from .fold import NORM_GROUPS, row_target
from .mixed import e2m1

logger = logging.getLogger(__name__)
# (values, the input's global amax) -> the values as the engine quantizes them
Quantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
class Group:
    """Projections that must share one input scale, and what the search learns about them."""

    members: list[tuple[str, Any]]
    fused: bool  # engines run the members as one GEMM with one weight global scale
    # Every keep_every-th token of each batch is kept to score candidates on (the statistics see
    # them all): about the scored tokens, not the whole corpus, stay in memory.
    keep_every: int = 1
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
        magnitude = x.float().abs()
        abs_sum, amax = magnitude.sum(0), magnitude.amax(0)
        self.abs_sum = abs_sum if self.abs_sum is None else self.abs_sum + abs_sum
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        self.tokens += x.shape[0]
        self.inputs.append(x[:: self.keep_every])


def keep_every(tokens: int, scored_tokens: int) -> int:
    """Which tokens a group keeps to score on, of ``tokens`` it will see: every n-th, n as the
    scoring picks them (so that keeping fewer changes no result)."""
    return max(1, tokens // scored_tokens)


def fold_groups(layer: torch.nn.Module, keep: int = 1) -> list[Group]:
    """The groups of ``layer``'s quantized projections whose AWQ scale can be folded away, each
    keeping every ``keep``-th token's input to score on."""
    from modelopt.torch.quantization.utils import is_quantized_linear

    def quantized(name: str) -> Any:
        try:
            module: Any = layer.get_submodule(name)
        except AttributeError:
            return None
        enabled = is_quantized_linear(module) and module.weight_quantizer.is_enabled
        return module if enabled and e2m1(module) else None  # a projection kept in FP8 is not searched

    groups = []
    for _norm, names in NORM_GROUPS:
        members = [(n, quantized(n)) for n in names]
        if all(m is not None for _, m in members):
            groups.append(Group(members, fused=True, keep_every=keep))
    for name, _module in layer.named_modules():
        target = row_target(name)
        if target is not None and quantized(name) is not None and quantized(target) is not None:
            groups.append(Group([(name, quantized(name))], fused=False, keep_every=keep))
    return groups


def search_and_apply(groups: list[Group], alpha_step: float, scored_tokens: int) -> None:
    """Give each group the scale (one of AWQ's for alpha = 0, ``alpha_step``, ... 1, or none) whose
    quantized outputs are closest to the unquantized ones, as its members' ``pre_quant_scale``.

    The statistics the candidates come from saw every calibration token; the candidates are scored
    on about ``scored_tokens`` of them, evenly spread (every n-th token of each batch), which is
    what the search costs."""
    from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth

    chosen = [(group, choose(group, alpha_step, scored_tokens)) for group in groups]
    for group, best in chosen:
        if best == "none":
            continue
        scale = group.scales[best]
        for _, module in group.members:
            if module.input_quantizer.amax is not None:
                # The per-channel maxima ModelOpt re-derives the global amax from when scales change.
                module.input_quantizer._amax_for_smoothing = group.amax.cpu()  # type: ignore[union-attr]
            apply_pre_quant_scale_and_smooth(module, (1.0 / scale).to(module.weight.device))


def choose(group: Group, alpha_step: float, scored_tokens: int) -> str:
    """Score ``group``'s candidates on the inputs it gathered (then dropped) and return the best's
    name: ``"none"`` or ``"alpha a"``, whose scale is ``group.scales[name]``."""
    alphas = [round(a, 6) for a in torch.arange(0, 1 + alpha_step / 2, alpha_step).tolist()]
    prepared = _prepare(group, alphas, scored_tokens)
    for x in group.inputs:
        _score(group, prepared, x)
    group.inputs.clear()
    best = min(group.losses, key=group.losses.__getitem__)
    logger.debug(
        "%s: %s (output error %.4g of max calibration's)",
        "+".join(n for n, _ in group.members),
        best,
        group.losses[best] / max(group.losses["none"], 1e-30),
    )
    return best


@dataclass
class _Prepared:
    """A group's candidates, ready to score: per candidate ``1 / s``, the input's global amax after
    the scale and the members' quantized ``W * s``, stacked (one GEMM)."""

    weight: torch.Tensor  # the members' unquantized weights, stacked, in the inputs' dtype
    quantize_input: Quantize | None
    stride: int  # every stride-th token of a batch is scored
    candidates: list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]]


def _prepare(group: Group, alphas: list[float], scored_tokens: int) -> _Prepared:
    first = group.members[0][1]
    quantize_weight, block = engine_quantize(first.weight_quantizer)
    quantize_input, _ = engine_quantize(first.input_quantizer, inputs=True)
    assert quantize_weight is not None and group.abs_sum is not None and group.amax is not None
    # Scored in the dtype the layer computes in (BF16 on GPUs and CPUs that multiply it natively):
    # rounding the outputs there moves every candidate's error alike.
    dtype = group.inputs[0].dtype if group.inputs else torch.float32
    act = group.abs_sum / group.tokens
    weights = [m.weight.detach().float() for _, m in group.members]
    w_stat = weight_scale(weights, block)
    group.scales = {f"alpha {a:g}": awq_scale(act, w_stat, a) for a in alphas}
    group.scales = {"none": torch.ones_like(act)} | group.scales
    group.losses = dict.fromkeys(group.scales, 0.0)
    stride = max(1, keep_every(group.tokens, scored_tokens) // group.keep_every)  # of the tokens kept
    prepared = _Prepared(torch.cat(weights).to(dtype), quantize_input, stride, [])
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


def _score(group: Group, prepared: _Prepared, x: torch.Tensor) -> None:
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


def engine_quantize(quantizer: Any, inputs: bool = False) -> tuple[Quantize | None, int]:
    """What an E2M1 block ``quantizer`` does to a tensor, in the checkpoint's arithmetic for weights
    and the engine's for ``inputs`` (dynamic per-block scales, the global amax given), and its block
    size; ``None`` when it is disabled (activations an engine leaves in BF16). For scales the
    quantizer was not calibrated with."""
    block_sizes = dict(quantizer.block_sizes or {})
    block = int(block_sizes.get(-1) or 16)
    if not quantizer.is_enabled:
        return None, block
    fmt = of_quantizer(quantizer.num_bits, block_sizes)
    if fmt is None or not fmt.e2m1:
        raise PipelineError(f"only E2M1 block formats can be searched, not num_bits={quantizer.num_bits} {block_sizes}")
    if fmt.block_scale == "e8m0":
        return (lambda x, _amax: mxfp4_fake_quant(x, block)), block
    if inputs:
        return (lambda x, amax: nvfp4_activations(x, nvfp4_global_scale_of(amax), block)), block
    return (lambda x, amax: nvfp4_fake_quant(x, block, amax)), block
