"""ModelOpt's quantizers for a recipe: the config that inserts them, and their calibrated state
kept and put back (a resumed run skips what an earlier one calibrated)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..algorithms import mixed
from ..device import Compute
from ..formats import KEPT_BF16, ROUTED_EXPERTS
from ..model.lazy import LazyWeights
from ..recipes import Recipe
from . import backend
from .session import METHOD

logger = logging.getLogger(__name__)

# Set on a model whose fused groups ``share_fused_scales`` gave one global scale.
SHARED_MARK = "_fp4prep_fused_scales_shared"


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """ModelOpt prints and draws its own progress bar; keep both in our log instead."""
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            yield chatter
    finally:
        logger.debug("modelopt: %s", chatter.getvalue().strip())


def quant_config(recipe: Recipe, compute: Compute, checkpoint_dir: Path | None = None) -> dict[str, Any]:
    """ModelOpt's config for ``recipe``: the format's preset, input quantizers on the engine's
    arithmetic, weight quantizers on the CPU backend where there is no CUDA, static NVFP4 weight
    scales for GPTQ, the projections the recipe keeps in FP8, what stays BF16 excluded, and layerwise
    calibration (one decoder layer at a time, checkpointed per layer in ``checkpoint_dir``) running
    the recipe's steps, or the preset's own max calibration where it has none."""
    import modelopt.torch.quantization as mtq

    config = copy.deepcopy(getattr(mtq, recipe.format.modelopt_config))
    entries = config["quant_cfg"]
    entries.extend(mixed.fp8_entries(recipe.fp8_modules))  # after the preset's: they override it
    if recipe.format.per_tensor_experts:
        entries.extend(_per_tensor_experts(entries))
    for entry in entries:
        cfg = entry.get("cfg")
        if not isinstance(cfg, dict):
            continue
        if str(entry.get("quantizer_name")).endswith("input_quantizer") and backend.handles(cfg.get("num_bits")):
            cfg["backend"] = backend.INPUTS  # the engine's arithmetic, on a GPU too
        elif not compute.cuda and backend.handles(cfg.get("num_bits")):
            cfg["backend"] = backend.NAME
        if recipe.static_weight_scales and entry.get("quantizer_name") == "*weight_quantizer":
            cfg["block_sizes"] = {**cfg["block_sizes"], "type": "static"}
    entries.extend({"quantizer_name": p, "enable": False} for p in KEPT_BF16)
    if not recipe.format.activations_quantized and not recipe.calibrate_for:
        entries.append({"quantizer_name": "*input_quantizer", "enable": False})
    algorithm = config.get("algorithm")
    if recipe.steps:
        algorithm = {"method": METHOD}
    if algorithm is not None:
        algorithm = {"method": algorithm} if isinstance(algorithm, str) else dict(algorithm)
        algorithm["layerwise"] = {
            **algorithm.get("layerwise", {}),
            "enable": True,
            # Max calibration only sets amax: the per-layer checkpoint needs no weights. The
            # recipe's steps change them: each layer is written back into the weights map.
            "calib_mutates_weights": recipe.mutates_weights,
            **({"checkpoint_dir": str(checkpoint_dir)} if checkpoint_dir else {}),
        }
        config["algorithm"] = algorithm
    return config


def _per_tensor_experts(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries that give routed experts the format's numbers per tensor: one weight scale, one
    static input scale from calibration's maximum."""
    preset = {e.get("quantizer_name"): e["cfg"] for e in entries if isinstance(e.get("cfg"), dict)}
    weight = {**copy.deepcopy(preset["*weight_quantizer"]), "axis": None}
    inputs = {k: copy.deepcopy(v) for k, v in preset["*input_quantizer"].items() if k not in ("type", "block_sizes", "axis")}
    return [
        {"quantizer_name": f"{ROUTED_EXPERTS}weight_quantizer", "cfg": weight},
        {"quantizer_name": f"{ROUTED_EXPERTS}input_quantizer", "cfg": inputs},
    ]


def declared_inputs_only(model: torch.nn.Module, recipe: Recipe) -> None:
    """After a recipe calibrated for another hardware's inputs (``Recipe.calibrate_for``), the model
    computes what the checkpoint declares again: its input quantizers off where the format has none."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    if recipe.calibrate_for and not recipe.format.activations_quantized:
        for name, module in model.named_modules():
            if isinstance(module, TensorQuantizer) and name.endswith("input_quantizer"):
                module.disable()


def share_fused_scales(model: torch.nn.Module, weights: LazyWeights | None = None) -> None:
    """Give fused groups (q/k/v, gate/up, each expert's gate/up) one global scale.

    Serving engines run these projections as one GEMM with one global scale; ModelOpt's export
    does this sharing too, and doing it before the fake-quant model is measured keeps that model
    identical to what the checkpoint will hold. ModelOpt finds the groups by a forward with every
    quantizer off, watching which projections take the same input, and then works on the
    quantizers' scales alone: where the model streams from ``weights``, that forward runs on zeros
    of the weights' shapes instead of reading them.
    """
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    shapes = {name: p.shape for name, p in model.named_parameters()}
    zeros = weights.shapes_only(shapes) if weights is not None else contextlib.nullcontext()
    with torch.no_grad(), quiet(), zeros:
        requantize_resmooth_fused_llm_layers(model)
    setattr(model, SHARED_MARK, True)


@contextlib.contextmanager
def sharing_done(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ModelOpt's streaming export skips its own sharing pass where ``share_fused_scales``
    already ran on ``model``: the pass is a forward through every layer (on a streamed model, a read
    of all its weights) whose work is already done and would come out the same."""
    if not getattr(model, SHARED_MARK, False):
        yield
        return
    from modelopt.torch.export import unified_export_hf_streaming as streaming_export

    shared = streaming_export.requantize_resmooth_fused_llm_layers
    streaming_export.requantize_resmooth_fused_llm_layers = lambda model: None
    try:
        yield
    finally:
        streaming_export.requantize_resmooth_fused_llm_layers = shared


def save(model: torch.nn.Module, path: Path, extra: dict[str, Any]) -> None:
    """The calibrated quantizers (ModelOpt's state and every amax), so a resumed run skips calibration."""
    import modelopt.torch.opt as mto
    from modelopt.torch.quantization.utils import get_quantizer_state_dict

    state = {
        "modelopt_state": mto.modelopt_state(model),
        # Block scales kept on disk (``block_scales``) are saved as what they are here: their shapes.
        "quantizers": {
            k: {n: t if t.is_meta else t.cpu() for n, t in v.items()} for k, v in get_quantizer_state_dict(model).items()
        },
        **extra,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def restore(model: torch.nn.Module, path: Path, compute: Compute) -> dict[str, Any]:
    """Put back what ``save`` wrote (inside the run's ``Session``); returns its extra entries."""
    import modelopt.torch.opt as mto
    from modelopt.torch.quantization.nn import TensorQuantizer

    # Written by this pipeline into the job's own state directory, never user-supplied.
    state = torch.load(path, map_location=compute.device, weights_only=False)
    with quiet():
        mto.restore_from_modelopt_state(model, state.pop("modelopt_state"))
    saved = state.pop("quantizers")
    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or name not in saved:
            continue
        # Assigned, not copied: on a streamed model ModelOpt re-creates these buffers beside the
        # (meta) weights, and copying into a meta tensor keeps nothing.
        for key, value in saved[name].items():
            if key in module._buffers:
                module._buffers[key] = value
            else:
                module.register_buffer(key, value)
    return state
