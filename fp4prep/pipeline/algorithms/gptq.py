"""GPTQ on one decoder layer, after the AWQ search has chosen and folded its scales (or alone).

GPTQ rounds a projection's weights one input column at a time and spreads each column's rounding
error over the columns not yet rounded, through the inverse Hessian ``(X^T X)^-1`` of the
projection's inputs, so that the layer's outputs, not its weights, stay close. ModelOpt's ``gptq``
runs two more passes over the layer's calibration inputs (max calibration, then Hessians) and one
update per projection. Here the Hessians are gathered in the calibration pass made anyway, once
per input that several projections read (q/k/v, gate/up), and carried through the AWQ scale the
fold gave that input (``x * c`` has Hessian ``diag(c) H diag(c)``); projections that read one input
are rounded together, as one matrix. NVFP4's weight scales are static (fixed per block before the
update, as the checkpoint stores them), computed by ModelOpt's max calibration of the folded
weights and, where the recipe says so, searched on each block's outputs (``scale_search``); MXFP4's
are each block's own power of two (see ``quantize_layer``).

Routed experts, which transformers keeps stacked in one module per layer (and ModelOpt quantizes as
such, with one weight quantizer per expert), are rounded per expert (``ExpertHessians``,
``quantize_experts``): each expert's two projections get the Hessians of the inputs of the tokens
the router sent to that expert, and nothing else. An expert's Hessians take ``(hidden² +
intermediate²) × 4`` bytes; the experts of a layer are gathered in chunks that fit
``expert_hessian_bytes()`` (``FP4PREP_EXPERT_HESSIAN_MIB``, 4096 by default), one pass of the
layer's calibration inputs per chunk. A projection whose Hessian came from fewer tokens than its
input width (a singular Hessian: GPTQ would fit the few tokens it saw) keeps max calibration, and
is counted as such.

On CUDA the NVFP4 update is ModelOpt's Triton kernel (one launch per 128 columns). On a CPU, and
for MXFP4, it is ``gptq_update``, which rounds the 16 columns that share a block scale in one step:
each row's 16 roundings depend only on that row, so the 16-column chain compiles into one loop over
the rows, where column by column in eager torch it costs a dozen small operations per column. The
compile itself (10-20 s on a 2-core CPU) costs about what the dense demo's whole GPTQ takes in
eager torch, so a process compiles the chain only after its first 8,000 groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PipelineError
from ..formats import of_quantizer
from ..formats.numerics import E4M3_MAX, mxfp4_steps, static_nvfp4_scales
from . import scale_search
from .fold import Factors, calibrate_weights, static_scales
from .gptq_update import BLOCK, gptq_update
from .mixed import GroupError, e2m1, output_error


@dataclass
class _Input:
    """The Hessian of one input tensor, and the projections that read it."""

    names: list[str] = field(default_factory=list)
    hessian: torch.Tensor | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor, stride: int) -> None:
        """Add every ``stride``-th token of ``x`` to the Hessian."""
        flat = x.detach().reshape(-1, x.shape[-1])[::stride].float()
        if not flat.shape[0]:
            return
        if self.hessian is None:
            self.hessian = torch.zeros(flat.shape[1], flat.shape[1], device=flat.device)
        self.hessian.addmm_(flat.T, flat)
        self.tokens += flat.shape[0]


class Hessians:
    """``X^T X`` of the inputs of every quantized projection of ``layer``, one per distinct input.

    Projections that are called with the very same tensor (q/k/v after the norm, gate/up) share one
    Hessian; the others (o_proj, down_proj, a shared expert's) get their own. Collected by forward
    pre-hooks until ``remove``.
    """

    def __init__(self, layer: torch.nn.Module, stride: int = 1) -> None:
        from modelopt.torch.quantization.utils import is_quantized_linear

        self.stride = stride  # every stride-th token of a batch goes into the Hessians
        self.modules = {  # E2M1 ones: a projection kept in FP8 (mixed.py) is max-calibrated
            n: m for n, m in layer.named_modules() if is_quantized_linear(m) and m.weight_quantizer.is_enabled and e2m1(m)
        }
        self.inputs: dict[str, _Input] = {}  # first reader's name -> its input's Hessian
        self._last: tuple[torch.Tensor, str] | None = None  # the input seen last, and whose it is
        self._handles = [
            module.register_forward_pre_hook(lambda _m, args, n=name: self._observe(n, args[0]))
            for name, module in self.modules.items()
        ]

    def _observe(self, name: str, x: torch.Tensor) -> None:
        if self._last is not None and self._last[0] is x:  # another reader of the same tensor
            owner = self._last[1]
            if name not in self.inputs[owner].names:
                self.inputs[owner].names.append(name)
            return
        owner = next((o for o, i in self.inputs.items() if name in i.names), name)
        self.inputs.setdefault(owner, _Input([name])).add(x, self.stride)
        self._last = (x, owner)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


def expert_hessian_bytes() -> int:
    """The memory one layer's expert Hessians may take at once (``FP4PREP_EXPERT_HESSIAN_MIB``)."""
    return int(os.environ.get("FP4PREP_EXPERT_HESSIAN_MIB", "4096")) << 20


def fused_experts(layer: torch.nn.Module) -> dict[str, Any]:
    """The routed-expert modules of ``layer`` ModelOpt quantizes per expert, [experts, out, in] each."""
    return {
        name: m for name, m in layer.named_modules()
        if hasattr(m, "down_proj_weight_quantizers") and hasattr(m, "_current_expert_idx")
        and not getattr(m, "is_transposed", False)
    }


def expert_hessian_size(hidden: int, intermediate: int) -> int:
    """The bytes of one expert's two Hessians (fp32, ``gate_up``'s input and ``down``'s)."""
    return 4 * (hidden * hidden + intermediate * intermediate)


def experts_per_chunk(per_expert: int, budget: int) -> int:
    """How many experts' Hessians ``budget`` bytes hold (at least one)."""
    return max(1, budget // per_expert)


def expert_chunks(layer: torch.nn.Module, budget: int) -> list[range]:
    """The experts whose Hessians are gathered together: as many as ``budget`` bytes hold."""
    modules = fused_experts(layer)
    if not modules:
        return []
    module = next(iter(modules.values()))
    first = getattr(module, module._first_proj_attr)
    experts, hidden, intermediate = first.shape[0], first.shape[-1], module.down_proj.shape[-1]
    size = experts_per_chunk(expert_hessian_size(hidden, intermediate) * len(modules), budget)
    return [range(start, min(start + size, experts)) for start in range(0, experts, size)]


class ExpertHessians:
    """Per routed expert, ``X^T X`` of its two projections' inputs, from the tokens routed to it.

    transformers runs each expert as two ``F.linear`` calls on the rows of the tokens the router
    sent it; ModelOpt's quantized experts call the projection's input quantizer on that input right
    after setting which expert runs (``_current_expert_idx``), so a pre-hook on the two input
    quantizers sees each expert's inputs and only them. Only the experts in ``experts`` are kept.
    """

    def __init__(self, layer: torch.nn.Module, stride: int, experts: range) -> None:
        self.stride = stride
        self.experts = experts
        self.modules = fused_experts(layer)
        self.inputs: dict[tuple[str, str, int], _Input] = {}  # (module, projection, expert)
        self._handles = []
        for name, module in self.modules.items():
            first = getattr(module, module._first_proj_input_quantizer_attr)
            for quantizer, proj in ((first, module._first_proj_attr), (module.down_proj_input_quantizer, "down_proj")):
                self._handles.append(quantizer.register_forward_pre_hook(
                    lambda _q, args, n=name, m=module, p=proj: self._observe(n, m, p, args[0])
                ))

    def _observe(self, name: str, module: Any, proj: str, x: torch.Tensor) -> None:
        expert = int(module._current_expert_idx)
        if expert not in self.experts:
            return
        if x.numel():
            self.inputs.setdefault((name, proj, expert), _Input([proj])).add(x, self.stride)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def fold(self, factors: Factors, prefix: str) -> None:
        """Carry the experts' folded scales into the ``down_proj`` Hessians gathered before the fold
        (``x * c`` has Hessian ``diag(c) H diag(c)``); ``factors`` as ``expert_awq`` returns them."""
        for (name, proj, expert), entry in self.inputs.items():
            scale = factors.get(f"{prefix}{name}.{proj}", {}).get("in_scale")
            if scale is None or entry.hessian is None:
                continue
            c = scale[expert].to(entry.hessian.device, torch.float32)
            entry.hessian.mul_(c[:, None] * c[None, :])


@dataclass
class _ExpertSlice:
    """One expert's weight of a fused expert tensor (a view) and its quantizer, as ``_update`` takes them."""

    weight: torch.Tensor
    weight_quantizer: Any


@torch.no_grad()
def quantize_experts(
    hessians: ExpertHessians, damp: float, order: bool = False, exponents: str = "ceil", nv_scales: str = "max"
) -> dict[str, list[int]]:
    """GPTQ on each gathered expert projection whose Hessian came from at least as many tokens as
    its input width; the others keep their max-calibrated weights. Returns, per expert module, the
    projections rounded and those kept: ``[rounded, kept]``."""
    counts: dict[str, list[int]] = {}
    for name, module in hessians.modules.items():
        count = counts.setdefault(name, [0, 0])
        for proj in (module._first_proj_attr, "down_proj"):
            weight = getattr(module, proj)
            quantizers = getattr(module, f"{proj}_weight_quantizers")
            for expert in hessians.experts:
                entry = hessians.inputs.get((name, proj, expert))
                if entry is None or entry.hessian is None or entry.tokens < weight.shape[-1]:
                    count[1] += 1
                    continue
                quantizer = quantizers[expert]
                if not (_is_mxfp4(quantizer) or static_scales(quantizer)):
                    raise PipelineError(f"GPTQ needs static NVFP4 weight scales; {name}.{proj}[{expert}] has dynamic ones")
                _update(
                    [_ExpertSlice(weight.data[expert], quantizer)], entry.hessian / entry.tokens, damp, order, exponents, nv_scales
                )
                count[0] += 1
    return counts


def _is_mxfp4(quantizer: Any) -> bool:
    fmt = of_quantizer(quantizer.num_bits, quantizer.block_sizes)
    return fmt is not None and fmt.block_scale == "e8m0"


@torch.no_grad()
def quantize_layer(
    layer: torch.nn.Module, hessians: Hessians, prefix: str, factors: Factors, damp: float, order: bool = False,
    exponents: str = "ceil", nv_scales: str = "max",
) -> list[GroupError]:
    """Weight scales for the (folded) layer, then GPTQ's rounding of its weights.

    NVFP4 weights need static scales (the checkpoint stores what calibration fixed; max
    calibration of the folded weights sets them here). MXFP4's power-of-two scales are the block
    maxima's, computed again at export: a block GPTQ rounded on the grid of scale ``s`` exports on
    the same grid, or, if its largest value fell to ``3 s`` or below, on the grid of ``s / 2`` or
    finer, which holds every value of the coarser one up to ``3 s``; either way the same values.

    ``factors`` says what folding multiplied each projection's input by (``in_scale``, keyed by
    ``prefix`` + name + ``.weight``); the Hessians, of the unquantized inputs, were gathered before
    that. A projection no calibration token reached keeps its max-calibrated weights.

    Returns each group's rounding error (the projections that read one input, by full name), which
    ``mixed.select`` ranks."""
    for name, module in hessians.modules.items():
        quantizer = module.weight_quantizer
        if not (_is_mxfp4(quantizer) or static_scales(quantizer)):
            raise PipelineError(f"GPTQ needs static NVFP4 weight scales; {name} has dynamic ones")
    calibrate_weights(layer, keep_experts=True)  # the block scales GPTQ rounds against, from the folded weights
    errors = []
    for entry in hessians.inputs.values():
        if entry.hessian is None or entry.tokens == 0:
            continue
        hessian = entry.hessian / entry.tokens
        scale = factors.get(prefix + entry.names[0] + ".weight", {}).get("in_scale")
        if scale is not None:
            c = scale.to(hessian.device, torch.float32)
            hessian = hessian * c[:, None] * c[None, :]
        modules = [hessians.modules[n] for n in entry.names]
        before = [m.weight.detach().clone() for m in modules]
        _update(modules, hessian, damp, order, exponents, nv_scales)
        moved = [output_error(w, m.weight, hessian) for w, m in zip(before, modules, strict=True)]
        errors.append(GroupError(
            tuple(prefix + n for n in entry.names), sum(e for e, _ in moved), sum(r for _, r in moved),
            sum(w.numel() for w in before),
        ))
    return errors


def _update(
    modules: list[Any], hessian: torch.Tensor, damp: float, order: bool = False, exponents: str = "ceil", nv_scales: str = "max"
) -> None:
    """GPTQ on the modules that read one input, their rows stacked into one matrix; ``order``,
    ``exponents``: ``gptq_rounding``'s column order, ``numerics.mxfp4_steps``' rule for MXFP4 blocks;
    ``nv_scales``: NVFP4's block scales as max calibration set them (``max``) or searched on the
    block's outputs first (``search``, ``scale_search.search``)."""
    weights = [m.weight.detach().float() for m in modules]
    weight = torch.cat(weights)
    device = weight.device
    hessian = hessian.to(device)
    quantizers = [m.weight_quantizer for m in modules]
    group = int(quantizers[0].block_sizes.get(-1) or 16)
    mxfp4 = _is_mxfp4(quantizers[0])
    if nv_scales == "search" and not mxfp4:
        from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

        for w, q in zip(weights, quantizers, strict=True):
            scale_search.search(w, hessian, q, group, fp8_max_for_normalization(q))
    if order or mxfp4 or not _fused_nvfp4(weight, weights, quantizers, hessian, damp, group):
        scales = (
            mxfp4_steps(weight, group, exponents, hessian.diagonal()) if mxfp4 else _nvfp4_scales(weights, quantizers, group)
        )
        weight = gptq_rounding(weight, hessian, scales, group, damp, order)
    start = 0
    for m, w in zip(modules, weights, strict=True):
        m.weight.data.copy_(weight[start : start + w.shape[0]].to(m.weight.dtype))
        start += w.shape[0]


def gptq_rounding(
    weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, group: int, damp: float, order: bool,
) -> torch.Tensor:
    """``weight`` rounded by GPTQ on ``scales`` (one per block of ``group`` columns); with ``order``,
    in activation order: the input columns with the Hessian's largest diagonal first, so that the
    errors of the inputs that weigh most are spread over all the others, each column still on its
    own block's scale. Returns the rounded weight in its stored column order: ``weight`` itself,
    rounded in place, in stored order; a new tensor in activation order."""
    from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse

    if not order:
        gptq_update(weight, compute_hessian_inverse(hessian, weight, damp), scales, group, BLOCK)
        return weight
    permutation = torch.argsort(hessian.diagonal(), descending=True)
    permuted = weight[:, permutation].contiguous()
    h_inv = compute_hessian_inverse(hessian[permutation][:, permutation], permuted, damp)
    gptq_update(permuted, h_inv, scales.repeat_interleave(group, 1)[:, permutation].contiguous(), group, BLOCK)
    return permuted[:, torch.argsort(permutation)]


def _nvfp4_scales(weights: list[torch.Tensor], quantizers: list[Any], group: int) -> torch.Tensor:
    """The static NVFP4 block scales (E4M3 block scale times the global one) of the stacked weights."""
    from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

    return torch.cat([
        static_nvfp4_scales(
            q.amax.reshape(w.shape[0], w.shape[1] // group).float(), q.global_amax, fp8_max=fp8_max_for_normalization(q)
        ).to(w.device)
        for q, w in zip(quantizers, weights, strict=True)
    ])


def _fused_nvfp4(
    weight: torch.Tensor, weights: list[torch.Tensor], quantizers: list[Any], hessian: torch.Tensor, damp: float, group: int
) -> bool:
    """ModelOpt's Triton kernel for NVFP4 on CUDA (one launch per block of columns), in place, where
    it applies (the stacked weights share one global scale); False where it doesn't."""
    from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

    global_amax = quantizers[0].global_amax.float()
    if not (
        weight.device.type == "cuda"
        and all(torch.equal(q.global_amax.float(), global_amax) for q in quantizers)
        and all(fp8_max_for_normalization(q) == E4M3_MAX for q in quantizers)
    ):
        return False
    from modelopt.torch.quantization.utils.calib_utils import (
        compute_hessian_inverse,
        gptq_blockwise_update_fused_scalar,
    )

    amax = torch.cat([q.amax.reshape(w.shape[0], w.shape[1] // group).float() for q, w in zip(quantizers, weights, strict=True)])
    h_inv = compute_hessian_inverse(hessian, weight, damp)
    gptq_blockwise_update_fused_scalar(weight, amax, global_amax.item() / (6.0 * E4M3_MAX), h_inv, BLOCK, group)
    return True
