"""A transformers model whose weights stay in a lazy map until the module that needs them runs.

``build`` makes the model from its config with every parameter on the meta device (no memory), then
attaches accelerate's offload hooks with our map as their ``weights_map``: right before a decoder
layer (or the final norm, or the output head) runs, its tensors are read from the map onto the
compute device, and right after, they go back to meta. The whole-model forward, ``generate``-style
decoding with a KV cache, ModelOpt's layerwise calibration (which keeps one layer materialized
while it replays that layer's inputs) and ModelOpt's streaming export all work unchanged on such a
model, with one layer's weights in memory at a time.

The input embeddings stay resident on the device (and the output head when it shares their
weights): a model's first parameter decides ``model.device``, which transformers and ModelOpt use to
place inputs, and the embeddings are needed by every forward anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..device import Compute
from ..errors import UserError
from .configs import hf_config
from .lazy import LazyWeights


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder's ``ModuleList`` of layers and its dotted name."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("layers") and len(module) > 0:
            return name, module
    raise UserError(f"{type(model).__name__} has no list of decoder layers that can be streamed")


def build(
    config: dict[str, Any],
    weights: LazyWeights,
    compute: Compute,
    source_dir: Path,
    before_hooks: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """The model of ``config`` reading its weights from ``weights``, one module at a time."""
    return attach(skeleton(config, weights, compute, source_dir), weights, compute, before_hooks)


def skeleton(config: dict[str, Any], weights: LazyWeights, compute: Compute, source_dir: Path) -> Any:
    """The model of ``config`` with every parameter on the meta device: its shapes, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    hf = hf_config(config, source_dir)
    # Experts one F.linear at a time: the reference semantics, and the only path ModelOpt's
    # quantized experts intercept. transformers may otherwise pick batched kernels whose rounding
    # differs, so the reference, the calibrated model and the reader would not agree.
    hf._experts_implementation = "eager"
    with init_empty_weights():  # parameters on meta; buffers (rotary tables) computed for real
        model = AutoModelForCausalLM.from_config(hf, dtype=compute.dtype)
    model.eval()
    model.requires_grad_(False)
    _check_names(model, weights)
    return model


def attach(
    model: Any,
    weights: LazyWeights,
    compute: Compute,
    before_hooks: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """Load what stays resident and hook every other module to read its weights when it runs.

    ``before_hooks`` may replace modules' ``forward`` methods: accelerate's hooks wrap whatever
    ``forward`` is in place when they are attached.
    """
    from accelerate.hooks import attach_align_device_hook_on_blocks

    for name, buffer in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        # Persistent buffers the checkpoint holds (a router's bias) come from it; the rest (rotary
        # tables) were computed when the skeleton was built.
        value = weights[name].to(buffer.dtype) if name in weights else buffer
        module._buffers[leaf] = value.to(compute.device)

    embeddings = model.get_input_embeddings()
    name = _name_of(model, embeddings)
    embeddings.weight = torch.nn.Parameter(weights[f"{name}.weight"].to(compute.device), requires_grad=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        model.tie_weights()

    if before_hooks is not None:
        before_hooks(model)
    layers_name, layers = decoder_layers(model)
    blocks = [f"{layers_name}.{i}" for i in range(len(layers))]
    inside = {id(m) for layer in layers for m in layer.modules()}
    resident = {id(m) for m in embeddings.modules()}
    if tied:
        resident |= {id(m) for m in model.get_output_embeddings().modules()}
    for module_name, module in model.named_modules():
        owns = any(p is not None for p in module._parameters.values())
        if owns and id(module) not in inside and id(module) not in resident:
            blocks.append(module_name)
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": compute.device, **dict.fromkeys(blocks, compute.device)},
        offload=dict.fromkeys(blocks, True),
        weights_map=weights,
        skip_keys=["cache", "past_key_values"],  # the KV cache stays where the model keeps it
    )
    return model


def layer_bytes(model: torch.nn.Module, weights: LazyWeights, dtype: torch.dtype) -> list[int]:
    """The size of each decoder layer's weights in ``dtype``, read from the map's shapes."""
    layers_name, layers = decoder_layers(model)
    size = torch.empty(0, dtype=dtype).element_size()
    sizes = []
    for i, layer in enumerate(layers):
        prefix = f"{layers_name}.{i}."
        sizes.append(sum(weights.numel(prefix + n) * size for n, _ in _named_tensors(layer)))
    return sizes


def resident_bytes(model: Any, dtype: torch.dtype) -> int:
    """What stays on the device between layers: the input embeddings (shared with the head if tied)."""
    weight = model.get_input_embeddings().weight
    return weight.numel() * torch.empty(0, dtype=dtype).element_size()


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters())


def _name_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise UserError(f"{type(model).__name__}: its input embeddings are not one of its modules")


def _check_names(model: Any, weights: LazyWeights) -> None:
    expected = set(model.state_dict())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    output = model.get_output_embeddings()
    output_name = _name_of(model, output) if output is not None else None
    optional = {f"{output_name}.weight"} if tied and output_name else set()
    non_persistent = {
        f"{name}.{leaf}" if name else leaf
        for name, module in model.named_modules()
        for leaf in getattr(module, "_non_persistent_buffers_set", ())
    }
    have = set(weights)
    missing = sorted(expected - have - optional - non_persistent)
    unexpected = sorted(have - expected)
    if missing or unexpected:
        raise UserError(
            "the checkpoint's tensors do not match its config.json: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
