"""Calibration and quantization with NVIDIA ModelOpt under a fixed recipe.

Without CUDA, E2M1 quantizers run through our registered pure-torch backend (``fakequant``);
on a CUDA machine ModelOpt's own kernels run. MoE routers are watched during calibration so that
every expert is known to have seen tokens before anything is exported.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable

import torch

from . import fakequant
from .errors import PipelineError
from .recipes import Recipe

logger = logging.getLogger(__name__)
CALIBRATION_BATCH = 4


class ExpertCounter:
    """Counts, per MoE layer, the calibration tokens routed to each expert."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            experts = getattr(module, "experts", None)
            gate = getattr(module, "gate", None)
            if experts is None or gate is None:
                continue
            n_experts = _expert_count(experts)
            if n_experts is None:
                continue
            self.counts[name] = torch.zeros(n_experts, dtype=torch.long)
            self._handles.append(gate.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.dtype not in (torch.int64, torch.int32):
                return
            counts = self.counts[name]
            counts += torch.bincount(indices.reshape(-1).cpu(), minlength=len(counts))[: len(counts)]

        return hook

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


def use_cpu_backend(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type != "cuda"


def calibrate(
    model: torch.nn.Module,
    recipe: Recipe,
    sequences: list[torch.Tensor],
    report: Callable[[float], None],
) -> dict[str, list[int]]:
    """Insert the recipe's quantizers and calibrate them on ``sequences``.

    Returns calibration tokens per expert for each MoE layer, and refuses if any expert got none.
    """
    import modelopt.torch.quantization as mtq

    cpu = use_cpu_backend(model)
    if cpu:
        fakequant.register()
    device = next(model.parameters()).device
    counter = ExpertCounter(model)

    passes = []

    def forward_loop(m: torch.nn.Module) -> None:
        passes.append(1)
        with torch.no_grad():
            # Equal-length sequences in small batches: same max statistics, better matmuls.
            for start in range(0, len(sequences), CALIBRATION_BATCH):
                batch = torch.stack(sequences[start : start + CALIBRATION_BATCH]).to(device)
                m(batch, use_cache=False)
                report(min(start + CALIBRATION_BATCH, len(sequences)) / len(sequences))

    chatter = io.StringIO()  # ModelOpt prints to stdout; keep it in our log instead
    try:
        with contextlib.redirect_stdout(chatter):
            mtq.quantize(model, recipe.quant_config(use_cpu_backend=cpu), forward_loop)
        if not passes and counter.counts:
            # A fully dynamic recipe (MXFP4) has no statistics to collect, so ModelOpt skips the
            # loop; for an MoE model the corpus still goes through once so that expert coverage
            # is known.
            forward_loop(model)
    finally:
        counter.remove()
        logger.debug("modelopt: %s", chatter.getvalue().strip())
    uncovered = counter.uncovered()
    if uncovered:
        raise PipelineError(
            f"{len(uncovered)} MoE experts received no calibration tokens "
            f"({', '.join(uncovered[:4])}{', ...' if len(uncovered) > 4 else ''}); "
            "refusing to export uncalibrated experts: calibrate on a larger corpus"
        )
    return counter.as_lists()


def use_reference_numerics(model: torch.nn.Module) -> None:
    """Switch every quantizer to our pure-torch numerics, the export's own arithmetic.

    On the CPU they already run it; on CUDA, ModelOpt's kernels calibrated the model and this
    makes the fake-quant reference bit-comparable with the checkpoint's independent reload.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer

    fakequant.register()
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

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
