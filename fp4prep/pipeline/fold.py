"""Folding AWQ's per-channel scales away, so that a checkpoint is plain NVFP4 / MXFP4.

AWQ moves a per-input-channel scale ``s`` from a projection's activations into its weights
(``x / s`` times ``W * s``). Engines run no such scale, so it goes into whatever makes the
projection's input: the norm before q/k/v or gate/up (one scale for the whole group), ``up_proj``'s
rows for ``down_proj``, or ``v_proj``'s rows for ``o_proj`` when the scale is the same for the query
heads that share a key-value head. The tables here say what can be folded; ``awq.search`` searches
only scales that can.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import PipelineError

# Projections that read one norm's output, by the names the dense decoder layers we serve use; and
# the projection whose input is another's output through an elementwise product (a gated MLP, a
# shared expert or a routed one): ``<prefix>down_proj``'s scale goes to ``<prefix>up_proj``'s rows.
NORM_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)
ROW_SOURCE, ROW_TARGET = "down_proj", "up_proj"
# The attention output's projection reads each head's weighted sum of values, so its scale can go to
# ``v_proj``'s rows, if it is the same for the query heads that share a key-value head.
HEAD_SOURCE, HEAD_TARGET = "self_attn.o_proj", "self_attn.v_proj"

# Per quantized weight, what folding did to it: the stored weight is the merged one times
# ``1 / in_scale`` per input column and times ``out_scale`` per output row.
Factors = dict[str, dict[str, torch.Tensor]]


def row_target(name: str) -> str | None:
    """The projection whose output rows take ``name``'s input scale (``up_proj`` for ``down_proj``)."""
    if name == ROW_SOURCE or name.endswith("." + ROW_SOURCE):
        return name[: -len(ROW_SOURCE)] + ROW_TARGET
    return None


def head_tie(layer: torch.nn.Module) -> tuple[int, int, int] | None:
    """``(key-value heads, query heads per key-value head, head size)`` of ``layer``'s attention, when
    its output projection's input is laid out by query head (Llama-style attention)."""
    attention = getattr(layer, "self_attn", None)
    head_dim, groups = getattr(attention, "head_dim", None), getattr(attention, "num_key_value_groups", None)
    try:
        source: Any = layer.get_submodule(HEAD_SOURCE)
        target: Any = layer.get_submodule(HEAD_TARGET)
    except AttributeError:
        return None
    values, inputs = int(target.weight.shape[0]), int(source.weight.shape[1])
    if not isinstance(head_dim, int) or not isinstance(groups, int) or values % head_dim:
        return None
    kv_heads = values // head_dim
    return (kv_heads, groups, head_dim) if inputs == kv_heads * groups * head_dim else None


def tied(scale: torch.Tensor, tie: tuple[int, int, int]) -> torch.Tensor:
    """``scale`` made equal across the query heads of each key-value head (their geometric mean)."""
    heads = scale.reshape(tie).log().mean(dim=1, keepdim=True).exp()
    return heads.expand(tie).reshape(-1)


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


def has_static_weight_scales(layer: torch.nn.Module) -> bool:
    return any(static_scales(getattr(m, "weight_quantizer", None)) for m in layer.modules())


@torch.no_grad()
def calibrate_weights(layer: torch.nn.Module) -> None:
    """Max-calibrate the weight quantizers of ``layer`` again, from its weights as they are now:
    the block scales, and the global scales fused projections share. Static weight scales are
    fixed when calibrated, so after the weights changed (a fold, a scale) they must be set again;
    activations keep the amax their calibration (and the fold) gave them."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import max_calibrate

    with set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*input_quantizer", "enable": False}]):
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


def _fold_into_rows(
    source: Any, target: Any, rows: torch.Tensor, source_name: str, target_name: str, factors: Factors
) -> None:
    """``source``'s pre_quant_scale goes to ``target``'s output rows (``rows``: that scale as
    ``target``'s rows see it); ``source``'s input is still ``x * scale``, made by ``target`` now."""
    scale = _pre_quant_scale(source).float()  # type: ignore[union-attr]
    _scale_weight(target, rows=rows)
    _recalibrate_weight(target)
    _drop_pre_quant_scale(source, scale)
    factors.setdefault(source_name + ".weight", {})["in_scale"] = scale.cpu()
    factors.setdefault(target_name + ".weight", {})["out_scale"] = rows.cpu()


@torch.no_grad()
def fold_pre_quant_scales(model: torch.nn.Module) -> Factors:
    """Fold AWQ's per-channel input scales away, so the checkpoint is plain NVFP4 / MXFP4.

    AWQ leaves each projection with its weight divided by a per-input-channel scale and its input
    multiplied by it (``pre_quant_scale``). vLLM's ModelOpt loader runs no ``pre_quant_scale``
    (it takes NVFP4, not NVFP4_AWQ), so each one must go, exactly (see ``fold_layer``). ``fold_awq``
    folds its scales as it picks them; this is for what is left (ModelOpt's ``awq_lite``).

    One decoder layer is materialized at a time, and what changed is written back into the weights
    map. Returns the factors the retention check needs to compare stored weights with merged ones.
    """
    from modelopt.torch.quantization.utils import enable_weight_access_and_writeback

    from .streaming import decoder_layers

    layers_name, layers = decoder_layers(model)
    name_to_module = dict(model.named_modules())
    factors: Factors = {}
    for index, layer in enumerate(layers):
        if not _scaled(layer):
            continue
        with enable_weight_access_and_writeback(layer, model, name_to_module):
            fold_layer(layer, f"{layers_name}.{index}.", factors)
    left = [n for n, m in model.named_modules() if _pre_quant_scale(m) is not None]
    if left:
        raise PipelineError(
            f"pre_quant_scale left on {len(left)} modules after folding ({', '.join(left[:3])})"
        )
    return factors


def _scaled(layer: torch.nn.Module) -> dict[str, Any]:
    from modelopt.torch.quantization.utils import is_quantized_linear

    return {n: m for n, m in layer.named_modules() if is_quantized_linear(m) and _pre_quant_scale(m) is not None}


@torch.no_grad()
def fold_layer(layer: torch.nn.Module, prefix: str, factors: Factors) -> None:
    """Fold the pre_quant_scales of one materialized decoder layer (``prefix``: its name and a dot)
    into what makes each projection's input, recording in ``factors`` what that did to each weight:

    - a projection whose output feeds another through an elementwise product (``up_proj`` before
      ``down_proj``, in a dense MLP or an expert) takes the second's scale on its output rows;
    - ``v_proj`` takes ``o_proj``'s on its rows, when the scale is the same for every query head
      that reads one key-value head (``fold_awq`` searches it so);
    - projections that read one norm's output (q/k/v, gate/up) are resmoothed to their average
      scale, which the norm's weight takes;
    - any other (``o_proj`` scaled per query head, as ``awq_lite`` does; routed experts' gate/up,
      which share their norm with every other expert) is undone: weight multiplied back,
      max-calibrated, as without AWQ.
    """
    scaled = _scaled(layer)
    modules = dict(layer.named_modules())
    for source in list(scaled):
        target = row_target(source)
        if target is not None and target in modules:
            rows = _pre_quant_scale(scaled[source]).float()  # type: ignore[union-attr]
            _fold_into_rows(scaled.pop(source), modules[target], rows, prefix + source, prefix + target, factors)
    tie = head_tie(layer)
    if HEAD_SOURCE in scaled and tie is not None:
        scale = _pre_quant_scale(scaled[HEAD_SOURCE]).float()  # type: ignore[union-attr]
        if torch.allclose(scale, tied(scale, tie), rtol=1e-6, atol=0):
            rows = scale.reshape(tie)[:, 0, :].reshape(-1)  # one per key-value head's channel
            o_proj, v_proj = scaled.pop(HEAD_SOURCE), modules[HEAD_TARGET]
            _fold_into_rows(o_proj, v_proj, rows, prefix + HEAD_SOURCE, prefix + HEAD_TARGET, factors)
    for norm_name, group in NORM_GROUPS:
        if not all(n in scaled for n in group):
            continue
        norm: Any = layer.get_submodule(norm_name)
        scales = [_pre_quant_scale(scaled[n]).float() for n in group]  # type: ignore[union-attr]
        # fold_awq gives a group one scale: then it is the norm's, exactly, and no weight changes.
        average = scales[0] if all(torch.equal(s, scales[0]) for s in scales) else torch.stack(scales).mean(0)
        for name, scale in zip(group, scales, strict=True):
            module = scaled.pop(name)
            if not torch.equal(scale, average):
                _scale_weight(module, columns=scale / average)
                _recalibrate_weight(module)
            _drop_pre_quant_scale(module, average)
            factors.setdefault(prefix + name + ".weight", {})["in_scale"] = average.cpu()
        norm.weight.data.copy_((norm.weight.data.float() * average).to(norm.weight.dtype))
    for module in scaled.values():  # nothing to fold into: back as without AWQ
        scale = _pre_quant_scale(module).float()  # type: ignore[union-attr]
        _scale_weight(module, columns=scale)
        _recalibrate_weight(module)
        _drop_pre_quant_scale(module, torch.ones_like(scale))
