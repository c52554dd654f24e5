"""GPTQ on the prepared model's inputs, towards the BF16 merged model's outputs, stage by stage.

An experiment, off in every recipe (``LayerPass.paired``): what the FP4 release path does, tried on
a BF16 base. Each layer's weights are rounded in the order the layer reads their inputs (q/k/v, o,
gate/up, down), each stage on the inputs the prepared model gives it (the layers and stages before
it rounded, each input quantized as the engine quantizes it), towards what the merged model's
weight gives from the merged model's own inputs: ``||Q(X~) Qᵀ - X Wᵀ||²`` is GPTQ on ``Q(X~)``'s
Hessian towards ``W + W Dᵀ Q(X~) H~⁻¹`` (``D = X - Q(X~)``). The prepared model's hidden states are
carried from layer to layer beside ModelOpt's (the merged model's). Dense projections only; a run
that resumes does not have them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fold import calibrate_weights
from .gptq import Hessians, _update
from .held_gptq import _towards_merged
from .mixed import GroupError, output_error

# The prepared model's inputs as the engine quantizes them (True), or as the layers before give them
# (False): the activations' own rounding noise in the target makes least squares shrink the weights.
QUANTIZED_INPUTS = False


class PreparedStates:
    """The prepared model's hidden states entering the next layer, one per calibration batch."""

    def __init__(self) -> None:
        self.hidden: list[torch.Tensor] | None = None


class _Stop(Exception):
    """Raised once a run has what it came for: the rest of the layer is not computed."""


Call = tuple[tuple[Any, ...], dict[str, Any]]


def _run(layer: torch.nn.Module, hidden: torch.Tensor, call: Call) -> Any:
    """The layer's own forward on ``hidden`` with one replay's other arguments (ModelOpt's layerwise
    forward replays its cached inputs whatever it is called with), a fresh key-value cache."""
    args, kwargs = call
    kwargs = dict(kwargs)
    cache = kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "reset"):
        cache.reset()
    forward = getattr(layer, "_original_forward", layer.forward)
    try:
        if args:
            return forward(hidden, *args[1:], **kwargs)
        return forward(**{**kwargs, "hidden_states": hidden})
    except _Stop:
        return None


def quantize_layer(
    layer: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None], hessians: Hessians, prefix: str,
    states: PreparedStates, damp: float, order: bool,
) -> list[GroupError]:
    """``layer``'s dense projections rounded stage by stage (``hessians.inputs``: the groups that read
    one input, in the order the layer reads them); ``states`` carried on through the rounded layer."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    stride = hessians.stride
    groups = [(owner, entry.names) for owner, entry in hessians.inputs.items() if entry.tokens]
    merged: dict[str, list[torch.Tensor]] = {owner: [] for owner, _ in groups}
    handles = [
        hessians.modules[owner].register_forward_pre_hook(
            lambda _m, args, o=owner: merged[o].append(_rows(args[0], stride))
        )
        for owner, _ in groups
    ]
    calls: list[Call] = []
    handles.append(layer.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True
    ))
    try:
        with set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*", "enable": False}]):
            forward_loop(layer)
    finally:
        for handle in handles:
            handle.remove()
    if states.hidden is None:  # the first layer: both models' inputs are the embeddings
        states.hidden = [args[0] if args else kwargs["hidden_states"] for args, kwargs in calls]
    calibrate_weights(layer, keep_experts=True)  # block scales from the folded, unrounded weights
    errors = []
    for owner, names in groups:
        modules = [hessians.modules[n] for n in names]
        h, cross = _paired_hessians(layer, modules[0], states.hidden, calls, merged[owner], stride)
        before = [m.weight.detach().float().clone() for m in modules]
        for m, w in zip(modules, before, strict=True):
            m.weight.data.copy_((w + _towards_merged(w, h, cross, damp)).to(m.weight.dtype))
        _update(modules, h, damp, order)
        moved = [output_error(w, m.weight, h) for w, m in zip(before, modules, strict=True)]
        errors.append(GroupError(
            tuple(prefix + n for n in names), sum(e for e, _ in moved), sum(r for _, r in moved),
            sum(w.numel() for w in before),
        ))
        merged[owner] = []
    with _weights_as_they_are(layer):
        outputs = [_run(layer, hidden, call) for hidden, call in zip(states.hidden, calls, strict=True)]
    states.hidden = [(out[0] if isinstance(out, tuple) else out).detach() for out in outputs]
    return errors


def _paired_hessians(
    layer: torch.nn.Module, module: Any, hidden: list[torch.Tensor], calls: list[Call], merged: list[torch.Tensor], stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q(X~)ᵀQ(X~)`` and ``Q(X~)ᵀ(X - Q(X~))`` per token: ``X~`` what ``module`` reads in the prepared
    model (``hidden`` through the layer as it is now), quantized as the engine quantizes it, ``X``
    what it reads in the merged model (``merged``, batch by batch)."""
    width = module.weight.shape[1]
    h, cross = torch.zeros(width, width), torch.zeros(width, width)
    tokens = 0

    def take(m: Any, args: tuple[Any, ...]) -> None:
        nonlocal tokens
        quantizer = m.input_quantizer
        xq = _rows(quantizer(args[0]) if QUANTIZED_INPUTS and quantizer.is_enabled else args[0], stride)
        h.addmm_(xq.T, xq)
        cross.addmm_(xq.T, merged[batch] - xq)
        tokens += xq.shape[0]
        raise _Stop

    handle = module.register_forward_pre_hook(take)
    try:
        with _weights_as_they_are(layer):
            for batch, (states, call) in enumerate(zip(hidden, calls, strict=True)):  # noqa: B007 (take reads batch)
                _run(layer, states, call)
    finally:
        handle.remove()
    return h / tokens, cross / tokens


def _weights_as_they_are(layer: torch.nn.Module) -> Any:
    """The weight quantizers off: the weights rounded so far are on their grid already (to BF16's
    precision), and the ones not yet rounded are read only after the input being gathered."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    return set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*weight_quantizer", "enable": False}])


def _rows(x: torch.Tensor, stride: int) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1])[::stride].float()
