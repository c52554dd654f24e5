"""Checks made before any work: can this device take the model one layer at a time, and can the
disk take the checkpoint? A run that can't finish says so at once, with the numbers, instead of
failing hours later."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from fp4prep.text import format_bytes

from .device import Compute, available_memory
from .errors import PipelineError
from .model import streaming
from .model.merge import MergedWeights
from .recipes import Recipe


def gptq_hessian_bytes(model: Any, matrices: int = 1) -> int:
    """The most GPTQ's Hessians take at once in one decoder layer (fp32): one ``in``² matrix per
    quantized Linear module (an upper bound: projections reading one input share theirs), plus the
    routed experts' of one chunk, ``min(experts, max(1, budget // per_expert)) × per_expert`` with
    ``per_expert = 4 × (hidden² + intermediate²)`` per expert module and ``budget`` the expert
    Hessian budget (``FP4PREP_EXPERT_HESSIAN_MIB``). ``matrices`` per input: 2 for a release's
    rounding, which keeps each input's cross term with the merged model's inputs beside its Hessian."""
    from .algorithms.gptq import expert_hessian_bytes, expert_hessian_size, experts_per_chunk

    budget = expert_hessian_bytes()
    _, layers = streaming.decoder_layers(model)
    most = 0
    for layer in layers:
        total = 0
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                total += 4 * module.in_features**2 * matrices
            gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
            if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3:
                experts, hidden, intermediate = gate_up.shape[0], gate_up.shape[-1], down.shape[-1]
                per_expert = expert_hessian_size(hidden, intermediate) * matrices
                total += min(experts, experts_per_chunk(per_expert, budget)) * per_expert
        most = max(most, total)
    return most


def awq_input_bytes(
    model: Any, calibration_tokens: int, element_size: int, scored_tokens: int = 2048, sequence_length: int = 512
) -> int:
    """The most the AWQ search keeps of one decoder layer's inputs to score candidates on: per fold
    group (q/k/v, gate/up, a dense or shared ``down_proj``), every n-th token of each batch,
    ``n = tokens // scored_tokens``: at most ``2 × scored_tokens`` plus one per batch; per routed
    expert (``down_proj``'s input) the same of the rows routed to it."""
    from .calibrate import CALIBRATION_BATCH

    batches = calibration_tokens // (CALIBRATION_BATCH * max(sequence_length, 1)) + 1

    def kept(tokens: int) -> int:
        return min(tokens, 2 * scored_tokens + batches)

    top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    _, layers = streaming.decoder_layers(model)
    most = 0
    for layer in layers:
        total = 0
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in ("q_proj", "gate_proj", "down_proj"):
                total += kept(calibration_tokens) * module.in_features
            down = getattr(module, "down_proj", None)
            if isinstance(down, torch.Tensor) and down.dim() == 3:
                experts = down.shape[0]
                total += experts * kept(calibration_tokens * max(top_k, 1) // experts) * down.shape[-1]
        most = max(most, total * element_size)
    return most


def check_memory(
    model: Any,
    weights: MergedWeights,
    compute: Compute,
    calibration_tokens: int,
    recipe: Recipe | None = None,
    sequence_length: int = 512,
    release: bool = False,
) -> int:
    """Refuse when one decoder layer's calibration can't fit the device; returns what it needs there.
    For a ``release`` base the rounding walks the prepared model beside the merged one: two more
    layers' worth of states (its inputs and outputs), and a cross term beside each Hessian."""
    layers = streaming.layer_bytes(model, weights, compute.dtype)
    largest = max(layers)
    resident = streaming.resident_bytes(model, compute.dtype)
    hidden = int(model.config.hidden_size)
    size = torch.empty(0, dtype=compute.dtype).element_size()
    # ModelOpt keeps one layer's captured inputs and the next layer's while it calibrates.
    activations = (5 if release else 3) * calibration_tokens * hidden * size
    hessians = gptq_hessian_bytes(model, 2 if release else 1) if recipe is not None and recipe.gptq else 0
    searched = (
        awq_input_bytes(model, calibration_tokens, size, recipe.awq.scored_tokens, sequence_length)
        if recipe is not None and recipe.awq else 0
    )
    # The layer, plus as much again for the quantized copy of each weight and the fused experts.
    need = resident + 2 * largest + activations + hessians + searched
    free = available_memory(compute.device)
    if need > free:
        raise PipelineError(
            f"this model can't be prepared on {compute.device} even one decoder layer at a time: "
            f"it needs about {format_bytes(need)} there (its largest layer is {format_bytes(largest)} in "
            f"{str(compute.dtype).removeprefix('torch.')}, held twice while it is quantized; the "
            f"embeddings {format_bytes(resident)}; calibration activations {format_bytes(activations)}"
            + (f"; {'the release rounding' if release else 'GPTQ'}'s Hessians {format_bytes(hessians)}" if hessians else "")
            + (f"; the AWQ search's inputs {format_bytes(searched)}" if searched else "")
            + f"), and {format_bytes(free)} is free. Run it on a device with more memory"
        )
    if compute.cuda:
        host_free = available_memory(torch.device("cpu"))
        host_need = 2 * max(layers)
        if host_need > host_free:
            raise PipelineError(
                f"this machine's memory can't stage one decoder layer for {compute.device}: that "
                f"needs about {format_bytes(host_need)} and {format_bytes(host_free)} is free"
            )
    return need


def check_disk(
    weights: MergedWeights, recipe: Recipe, work_dir: Path, output_dir: Path, hidden: int, calibration_tokens: int
) -> int:
    """Refuse when the work and output directories' disks can't take the checkpoint; returns its estimate."""
    output = recipe.format.checkpoint_bytes({n: weights.source.shape(n) for n in weights.source.names()})
    # ModelOpt's per-layer checkpoint keeps the next layer's inputs (float32 at most).
    state = 2 * calibration_tokens * hidden * 4 + (64 << 20)
    if recipe.mutates_weights:
        # The changed weights, in BF16, written back as each layer is calibrated.
        state += 2 * sum(weights.numel(n) for n in weights)
    if recipe.static_weight_scales:
        # Each calibrated layer's static block scales until export (FP32, one per 16 weights), and
        # again in ModelOpt's per-layer checkpoint of the quantizers until calibration ends.
        state += 2 * (sum(weights.numel(n) for n in weights) // 4)
    work, out = _existing(work_dir), _existing(output_dir)
    # The checkpoint is written in the work directory and moved into place: on the same disk that
    # is a rename, on another a copy.
    wanted = [(work_dir, work, output + state)]
    if out.stat().st_dev != work.stat().st_dev:
        wanted.append((output_dir, out, output))
    for directory, existing, need in wanted:
        free = shutil.disk_usage(existing).free
        if need > free:
            raise PipelineError(
                f"the disk under {directory} has {format_bytes(free)} free, and this checkpoint needs about "
                f"{format_bytes(need)} there (the {recipe.name} checkpoint is about {format_bytes(output)}): "
                "free some space or choose another directory"
            )
    return output


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path
