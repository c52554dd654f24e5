"""Folding AWQ's per-channel scales away, so that a checkpoint is plain NVFP4 / MXFP4.

AWQ moves a per-input-channel scale ``s`` from a projection's activations into its weights
(``x / s`` times ``W * s``). Engines run no such scale, so it goes into whatever makes the
projection's input: the norm before q/k/v or gate/up (one scale for the whole group), or
``up_proj``'s rows for ``down_proj`` (its input is ``act(gate) * up``: scaling up's rows scales it).
The tables here say what can be folded; ``awq`` searches only scales that can, and folding is exact:
the layer computes the same function before rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PipelineError

# Projections that read one norm's output, by the names the decoder layers we serve use; and the
# projection whose input is another's output through an elementwise product (a gated MLP, a shared
# expert or a routed one): ``<prefix>down_proj``'s scale goes to ``<prefix>up_proj``'s rows.
NORM_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)
ROW_SOURCE, ROW_TARGET = "down_proj", "up_proj"

# Per quantized weight, what folding did to it: the stored weight is the merged one times
# ``1 / in_scale`` per input column and times ``out_scale`` per output row.
Factors = dict[str, dict[str, torch.Tensor]]


def row_target(name: str) -> str | None:
    """The projection whose output rows take ``name``'s input scale (``up_proj`` for ``down_proj``)."""
    if name == ROW_SOURCE or name.endswith("." + ROW_SOURCE):
        return name[: -len(ROW_SOURCE)] + ROW_TARGET
    return None


def _pre_quant_scale(module: Any) -> torch.Tensor | None:
    quantizer = getattr(module, "input_quantizer", None)
    if quantizer is None or not getattr(quantizer, "_enable_pre_quant_scale", False):
        return None
    return getattr(quantizer, "_pre_quant_scale", None)


def _drop_pre_quant_scale(module: Any, input_scale: torch.Tensor) -> None:
    """Remove the module's pre_quant_scale; its input is now ``x * input_scale`` without it."""
    quantizer = module.input_quantizer
    raw = getattr(quantizer, "_amax_for_smoothing", None)
    if quantizer.amax is not None and raw is not None:
        quantizer.amax = (
            (raw.to(input_scale.device).float() * input_scale.float()).amax().to(quantizer.amax.dtype)
        )
    delattr(quantizer, "_pre_quant_scale")
    quantizer._enable_pre_quant_scale = False


def _recalibrate_weight(module: Any) -> None:
    from modelopt.torch.quantization.model_calib import max_calibrate

    module.weight_quantizer.reset_amax()
    max_calibrate(module, lambda m: m.weight_quantizer(m.weight))


def static_scales(quantizer: Any) -> bool:
    """Whether ``quantizer``'s block scales are fixed in calibration (not computed as it quantizes)."""
    return (getattr(quantizer, "block_sizes", None) or {}).get("type") == "static"


@torch.no_grad()
def calibrate_weights(layer: torch.nn.Module, keep_experts: bool = False) -> None:
    """Max-calibrate the weight quantizers of ``layer`` again, from its weights as they are now:
    the block scales, and the global scales fused projections share. Static weight scales are
    fixed when calibrated, so after the weights changed (a fold, a scale) they must be set again;
    activations keep the amax their calibration (and the fold) gave them. ``keep_experts`` leaves
    routed experts' weight quantizers as they are (GPTQ rounded those experts on their scales)."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import max_calibrate

    keep = [{"quantizer_name": "*input_quantizer", "enable": False}]
    if keep_experts:
        keep.append({"quantizer_name": "*_weight_quantizers*", "enable": False})
    with set_quantizer_by_cfg_context(layer, keep):
        # From the weights alone: a max calibrator otherwise keeps the larger of its old and new
        # maxima, and a weight that shrank (a folded row) would keep its old, coarser scale.
        for name, quantizer in layer.named_modules():
            if "weight_quantizer" in name and getattr(quantizer, "is_enabled", False):
                quantizer.reset_amax()
        max_calibrate(layer)


def _scale_weight(module: Any, rows: torch.Tensor | None = None, columns: torch.Tensor | None = None) -> None:
    weight = module.weight.data.float()
    if rows is not None:
        weight = weight * rows.float().reshape(-1, 1)
        if getattr(module, "bias", None) is not None:  # the row's output, bias included
            module.bias.data.copy_((module.bias.data.float() * rows.float()).to(module.bias.dtype))
    if columns is not None:
        weight = weight * columns.float().reshape(1, -1)
    module.weight.data.copy_(weight.to(module.weight.dtype))


def _scaled(layer: torch.nn.Module) -> dict[str, Any]:
    from modelopt.torch.quantization.utils import is_quantized_linear

    return {n: m for n, m in layer.named_modules() if is_quantized_linear(m) and _pre_quant_scale(m) is not None}


@torch.no_grad()
def fold_layer(layer: torch.nn.Module, prefix: str) -> Factors:
    """Fold the pre_quant_scales of one materialized decoder layer (``prefix``: its name and a dot)
    into what makes each projection's input; returns what that did to each weight:

    - a projection whose output feeds another through an elementwise product (``up_proj`` before
      ``down_proj``, in a dense MLP or an expert) takes the second's scale on its output rows, and
      its weight scales are calibrated again;
    - projections that read one norm's output (q/k/v, gate/up) share one scale, which the norm's
      weight takes: no projection's weight changes.
    """
    factors: Factors = {}
    scaled = _scaled(layer)
    modules = dict(layer.named_modules())
    for source in list(scaled):
        target = row_target(source)
        if target is None or target not in modules:
            continue
        scale = _pre_quant_scale(scaled[source]).float()  # type: ignore[union-attr]
        _scale_weight(modules[target], rows=scale)
        _recalibrate_weight(modules[target])
        _drop_pre_quant_scale(scaled.pop(source), scale)
        factors.setdefault(prefix + source + ".weight", {})["in_scale"] = scale.cpu()
        factors.setdefault(prefix + target + ".weight", {})["out_scale"] = scale.cpu()
    for norm_name, group in NORM_GROUPS:
        if not all(n in scaled for n in group):
            continue
        scale = _pre_quant_scale(scaled[group[0]]).float()  # type: ignore[union-attr]
        for name in group:
            if not torch.equal(_pre_quant_scale(scaled[name]).float(), scale):  # type: ignore[union-attr]
                raise PipelineError(f"{prefix}{name}: its scale differs from {group[0]}'s, so the norm can't take it")
            _drop_pre_quant_scale(scaled.pop(name), scale)
            factors.setdefault(prefix + name + ".weight", {})["in_scale"] = scale.cpu()
        norm: Any = layer.get_submodule(norm_name)
        norm.weight.data.copy_((norm.weight.data.float() * scale).to(norm.weight.dtype))
    if scaled:
        raise PipelineError(f"{prefix}: no fold target for the scales of {', '.join(sorted(scaled))}")
    return factors
