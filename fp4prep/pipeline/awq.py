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

Each expert's ``down_proj`` folds into its own ``up_proj``; routed experts' gate/up (their norm
feeds every expert) are max-calibrated, never searched. With ``fold_attention_output``, ``o_proj``'s
scale is searched too, tied across the query heads that share a key-value head, and goes to
``v_proj``'s rows. Runs per decoder layer inside ModelOpt's layerwise calibration, on the layer it
is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import PipelineError
from .fold import HEAD_SOURCE, HEAD_TARGET, NORM_GROUPS, head_tie, row_target, tied

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

    class FoldAwqModeDescriptor(BaseCalibrateModeDescriptor):
        @property
        def config_class(self) -> type[QuantizeAlgorithmConfig]:
            return FoldAwqConfig

        _calib_func = search

    CalibrateModeRegistry.register_mode(FoldAwqModeDescriptor)


# --- the search -------------------------------------------------------------------------------

Quantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (values, global amax) -> fake-quant


def _fake_quant(quantizer: Any) -> tuple[Quantize | None, int]:
    """What ``quantizer`` does to a tensor, in the checkpoint's arithmetic, and its block size.

    ``None`` for a disabled quantizer (activations an engine leaves in BF16)."""
    from . import fakequant

    block_sizes = dict(quantizer.block_sizes or {})
    block = int(block_sizes.get(-1) or 16)
    if not quantizer.is_enabled:
        return None, block
    scale_bits = tuple(block_sizes.get("scale_bits") or ())
    if tuple(quantizer.num_bits) != (2, 1) or scale_bits not in ((4, 3), (8, 0)):
        raise PipelineError(
            f"{METHOD} searches E2M1 block formats only, not num_bits={quantizer.num_bits} {block_sizes}"
        )
    if scale_bits == (8, 0):
        return (lambda x, _amax: fakequant.mxfp4_fake_quant(x, block)), block
    return (lambda x, amax: fakequant.nvfp4_fake_quant(x, block, amax)), block


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
    # candidate -> the per-channel scale; candidate -> summed squared output error
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        abs_sum, amax = x.abs().sum(0), x.abs().amax(0)
        self.abs_sum = abs_sum if self.abs_sum is None else self.abs_sum + abs_sum
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        self.tokens += x.shape[0]


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
    **unused: Any,
) -> None:
    """ModelOpt calibration function: max-calibrate ``layer``, then give each fold group the scale
    (one of AWQ's, or none) whose quantized outputs are closest to the unquantized ones.

    The statistics the candidates come from see every calibration token; the candidates are scored
    on about ``scored_tokens`` of them, evenly spread (every n-th token of each batch), which is
    what the search costs."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth, max_calibrate

    groups = fold_groups(layer, attention_output=fold_attention_output)
    handles = [
        module.register_forward_pre_hook(lambda _m, args, g=group: g.observe(args[0]))
        for group in groups
        for _, module in group.members[:1]  # members read the same input
    ]
    try:
        max_calibrate(layer, forward_loop)
    finally:
        for handle in handles:
            handle.remove()
    groups = [g for g in groups if g.tokens > 0]  # an expert no token reached keeps max
    if not groups:
        return

    alphas = [round(a, 6) for a in torch.arange(0, 1 + alpha_step / 2, alpha_step).tolist()]
    prepared = [_prepare(group, alphas, scored_tokens) for group in groups]
    with set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*", "enable": False}]):
        handles = [
            group.members[0][1].register_forward_pre_hook(
                lambda _m, args, g=group, p=ready: _score(g, p, args[0])
            )
            for group, ready in zip(groups, prepared, strict=True)
        ]
        try:
            forward_loop(layer)
        finally:
            for handle in handles:
                handle.remove()
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
    the scale and each member's quantized ``W * s``."""

    weights: list[torch.Tensor]  # the members' unquantized weights, float32
    quantize_input: Quantize | None
    stride: int  # every stride-th token of a batch is scored
    candidates: list[tuple[str, torch.Tensor, torch.Tensor | None, list[torch.Tensor]]]


def _prepare(group: _Group, alphas: list[float], scored_tokens: int) -> _Prepared:
    first = group.members[0][1]
    quantize_weight, block = _fake_quant(first.weight_quantizer)
    quantize_input, _ = _fake_quant(first.input_quantizer)
    assert quantize_weight is not None and group.abs_sum is not None and group.amax is not None
    act = group.abs_sum / group.tokens
    weights = [m.weight.detach().float() for _, m in group.members]
    w_stat = weight_scale(weights, block)
    group.scales = {f"alpha {a:g}": awq_scale(act, w_stat, a) for a in alphas}
    if group.tie is not None:
        group.scales = {name: tied(scale, group.tie) for name, scale in group.scales.items()}
    group.scales = {"none": torch.ones_like(act)} | group.scales
    group.losses = dict.fromkeys(group.scales, 0.0)
    prepared = _Prepared(weights, quantize_input, max(1, group.tokens // scored_tokens), [])
    for name, scale in group.scales.items():
        scaled = [w * scale for w in weights]
        tops = [w.abs().amax() for w in scaled]
        if group.fused:  # one GEMM in the engine, one weight global scale: the largest
            tops = [torch.stack(tops).amax()] * len(tops)
        input_amax = (group.amax / scale).amax() if quantize_input is not None else None
        quantized = [quantize_weight(w, top) for w, top in zip(scaled, tops, strict=True)]
        prepared.candidates.append((name, 1.0 / scale, input_amax, quantized))
    return prepared


def _score(group: _Group, prepared: _Prepared, x: torch.Tensor) -> None:
    """Add each candidate's squared error on the group's outputs for the batch ``x`` to its loss."""
    x = x.detach().reshape(-1, x.shape[-1])[:: prepared.stride].float()
    if x.shape[0] == 0:
        return
    references = [x @ w.T for w in prepared.weights]
    for name, inverse, input_amax, quantized in prepared.candidates:
        scaled = x * inverse
        if prepared.quantize_input is not None:
            scaled = prepared.quantize_input(scaled, input_amax)  # type: ignore[arg-type]
        group.losses[name] += sum(
            float((scaled @ w.T - reference).pow(2).sum())
            for w, reference in zip(quantized, references, strict=True)
        )
