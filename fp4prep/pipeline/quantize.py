"""Calibration and quantization with NVIDIA ModelOpt under a fixed recipe, one layer at a time.

ModelOpt's layerwise calibration (``algorithm.layerwise``) runs the model's own forward with every
decoder layer but one replaced by a cheap placeholder, keeps the layer being calibrated materialized
while it replays that layer's captured inputs, and writes a per-layer checkpoint (quantizer state
and the next layer's inputs) so that a run that stops resumes from the last finished layer. On a
model from ``streaming.build`` that means one layer's weights in memory at a time.

Without CUDA, E2M1 quantizers run through our registered pure-torch backend (``fakequant``); on a
CUDA device ModelOpt's own kernels run. MoE routers are watched during calibration so that every
expert is known to have seen tokens before anything is exported.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import awq, fakequant, fold, gptq
from .device import Compute
from .errors import PipelineError
from .recipes import Recipe

logger = logging.getLogger(__name__)
CALIBRATION_BATCH = 4
CALIBRATION_DIR = "calibration"  # ModelOpt's per-layer checkpoint, inside the run's state directory
EXPERT_TOKENS_FILE = "expert_tokens.json"
FOLD_FACTORS_DIR = "fold_factors"  # what fold_awq's folding did, one file per finished layer


class ExpertCounter:
    """Counts, per MoE layer, the calibration tokens routed to each expert.

    Layerwise calibration runs each layer over the corpus more than once (to capture the next
    layer's inputs, then to calibrate), so a layer's first pass, ``batches`` router calls, is
    counted and the rest ignored. Finished layers are written to ``path`` so a resumed run keeps
    the counts of the layers it does not run again.
    """

    def __init__(self, model: torch.nn.Module, batches: int, path: Path | None = None) -> None:
        self.batches = batches
        self.path = path
        self.counts: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self._handles = []
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
            if self.calls[name] >= self.batches:
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


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """ModelOpt prints and draws its own progress bar; keep both in our log instead."""
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            yield chatter
    finally:
        logger.debug("modelopt: %s", chatter.getvalue().strip())


def resume_layer(state_dir: Path | None) -> int:
    """The decoder layer a calibration in ``state_dir`` would resume from (0: from the start)."""
    if state_dir is None:
        return 0
    from modelopt.torch.quantization.utils.layerwise_calib import detect_resume_point

    found = detect_resume_point(str(state_dir / CALIBRATION_DIR))
    return found[0] if found else 0


def calibrate(
    model: torch.nn.Module,
    recipe: Recipe,
    sequences: list[torch.Tensor],
    compute: Compute,
    report: Callable[[float], None],
    state_dir: Path | None = None,
) -> tuple[dict[str, list[int]], fold.Factors]:
    """Insert the recipe's quantizers and calibrate them on ``sequences``, layer by layer.

    With ``state_dir``, a calibration that stopped there earlier continues from its last finished
    layer. Returns calibration tokens per expert for each MoE layer (refusing if any expert got
    none), and what folding AWQ's scales during calibration did to each weight.
    """
    import modelopt.torch.quantization as mtq

    from .streaming import decoder_layers

    if not compute.cuda:
        fakequant.register()
        gptq.register()
    awq.register()
    n_layers = len(decoder_layers(model)[1])
    batches = [
        torch.stack(sequences[start : start + CALIBRATION_BATCH])
        for start in range(0, len(sequences), CALIBRATION_BATCH)
    ]
    counter = ExpertCounter(model, len(batches), state_dir / EXPERT_TOKENS_FILE if state_dir else None)
    start = resume_layer(state_dir)
    passes = []

    def forward_loop(m: torch.nn.Module) -> None:
        # ModelOpt calls this once per decoder layer, to capture that layer's inputs.
        passes.append(1)
        with torch.no_grad():
            for batch in batches:
                m(batch.to(compute.device), use_cache=False)
                report(min(1.0, (start + len(passes) - 1) / n_layers))

    config = recipe.quant_config(use_cpu_backend=not compute.cuda)
    if config.get("algorithm") is not None:
        algorithm = config["algorithm"]
        algorithm = {"method": algorithm} if isinstance(algorithm, str) else dict(algorithm)
        algorithm["layerwise"] = {
            **algorithm.get("layerwise", {}),
            "enable": True,
            # Max calibration only sets amax: the per-layer checkpoint needs no weights. AWQ
            # smooths them: each layer is written back into the weights map, and checkpointed.
            "calib_mutates_weights": recipe.mutates_weights,
            **({"checkpoint_dir": str(state_dir / CALIBRATION_DIR)} if state_dir else {}),
        }
        config["algorithm"] = algorithm
    folds = state_dir / FOLD_FACTORS_DIR if state_dir else None
    try:
        with quiet(), awq.folding(model, folds) as record:
            mtq.quantize(model, config, forward_loop)
        if not passes and counter.counts:
            # A fully dynamic recipe (MXFP4) has no statistics to collect, so ModelOpt skips the
            # loop; for an MoE model the corpus still goes through once so that expert coverage
            # is known.
            forward_loop(model)
    finally:
        counter.remove()
    report(1.0)
    uncovered = counter.uncovered()
    if uncovered:
        raise PipelineError(
            f"{len(uncovered)} MoE experts received no calibration tokens "
            f"({', '.join(uncovered[:4])}{', ...' if len(uncovered) > 4 else ''}); "
            "refusing to export uncalibrated experts: calibrate on a larger corpus"
        )
    return counter.as_lists(), record.factors


def use_reference_numerics(model: torch.nn.Module) -> None:
    """Switch every quantizer to our pure-torch numerics, the export's own arithmetic.

    On the CPU they already run it; on CUDA, ModelOpt's kernels calibrated the model and this
    makes the fake-quant reference bit-comparable with the checkpoint's independent reload.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    fakequant.register()
    fakequant.use_checkpoint_numerics_for_static_scales()
    for module in model.modules():
        if isinstance(module, TensorQuantizer) and module.is_enabled and fakequant.handles(module.num_bits):
            module.backend = fakequant.BACKEND_NAME


def share_fused_scales(model: torch.nn.Module) -> None:
    """Give fused groups (q/k/v, gate/up, each expert's gate/up) one global scale.

    Serving engines fuse these projections into one GEMM with one global scale; ModelOpt's
    export does this sharing too, and doing it before we measure the fake-quant model keeps
    that model identical to what the checkpoint will hold.
    """
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    with torch.no_grad(), quiet():
        requantize_resmooth_fused_llm_layers(model)


def save_quantizers(model: torch.nn.Module, path: Path, extra: dict[str, Any]) -> None:
    """The calibrated quantizers (ModelOpt's state and every amax), so a resumed run skips calibration."""
    import modelopt.torch.opt as mto
    from modelopt.torch.quantization.utils import get_quantizer_state_dict

    state = {
        "modelopt_state": mto.modelopt_state(model),
        "quantizers": {k: {n: t.cpu() for n, t in v.items()} for k, v in get_quantizer_state_dict(model).items()},
        **extra,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def restore_quantizers(model: torch.nn.Module, path: Path, compute: Compute) -> dict[str, Any]:
    """Put back what ``save_quantizers`` wrote; returns its extra entries."""
    import modelopt.torch.opt as mto
    from modelopt.torch.quantization.nn import TensorQuantizer

    fakequant.register()
    awq.register()
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
