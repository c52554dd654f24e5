"""AWQ's scale search on routed experts, each scale folded into the expert's own ``up`` rows.

A routed expert computes ``down(act(gate x) * up x)``, from one fused ``gate_up_proj`` row block
(gate rows, then up rows) and a ``down_proj`` per expert. Its ``down_proj`` input can take a
per-channel scale exactly as a dense MLP's does: ``up``'s rows times ``1 / s`` and ``down``'s columns
times ``s`` leave the expert's function unchanged, so each expert gets its own scale, searched on the
tokens the router sent it (``awq.choose``: weights and inputs quantized as the engine runs them,
no scale where none is better). ``gate_up``'s input is the norm's output that every expert and the
router read: one scale there would have to serve them all and change the router's input, so it is
not searched.

Folding is exact only where the expert's output is linear in ``up``; experts whose activation clamps
``up`` (a SwiGLU limit: DeepSeek-V4, gpt-oss and others) are left alone, as are experts stored
transposed. ``foldable`` tells them apart by probing the module's own gate function.

The experts' NVFP4 inputs share one global scale per projection (one input quantizer for all
experts, as the engines run them): each expert's candidates are scored on that expert's own input
range, and after folding the shared range becomes the largest of the experts' scaled ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import awq
from .fold import Factors
from .gptq import fused_experts


@dataclass
class _DownProj:
    """One expert's ``down_proj``, as ``awq.choose`` scores a group member."""

    weight: torch.Tensor  # a view of the fused tensor's slice
    weight_quantizer: Any
    input_quantizer: Any


def foldable(module: Any) -> bool:
    """Whether scaling ``up``'s rows by ``c`` scales the expert's activation output by ``c`` exactly."""
    if not getattr(module, "_is_gated", True) or getattr(module, "is_transposed", False):
        return False
    if not hasattr(module, "gate_up_proj") or not hasattr(module, "down_proj"):
        return False
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:  # transformers' plain gated expert: act(gate) * up
        return hasattr(module, "act_fn")
    generator = torch.Generator().manual_seed(0)
    inner = module.down_proj.shape[-1]
    gate_up = torch.randn(4, 2 * inner, generator=generator) * 20  # wide enough to meet any clamp
    c = torch.rand(inner, generator=generator) * 3.75 + 0.25
    scaled = gate_up.clone()
    scaled[:, inner:] *= c
    with torch.no_grad():
        return bool(torch.allclose(apply_gate(scaled), apply_gate(gate_up) * c, rtol=1e-4, atol=1e-4))


def keep_every(layer: torch.nn.Module, tokens: int, scored_tokens: int) -> int:
    """Which rows an expert's group keeps to score on, for ``tokens`` calibration tokens through
    ``layer``: as ``awq.keep_every`` for the rows an expert sees on average (``tokens × top_k /
    experts``; top-k read off the router, 1 where the layer doesn't say: keeping more, never fewer)."""
    experts = max((m.down_proj.shape[0] for m in fused_experts(layer).values()), default=1)
    top_k = max((int(v) for m in layer.modules() if isinstance(v := getattr(m, "top_k", None), int)), default=1)
    return awq.keep_every(tokens * top_k // experts, scored_tokens)


class ExpertGroups:
    """One AWQ group per (expert module, expert): its ``down_proj`` inputs, from a pre-hook on the
    module's down input quantizer (called right after ModelOpt set which expert runs)."""

    def __init__(self, layer: torch.nn.Module, keep: int = 1) -> None:
        self.keep = keep  # every keep-th row an expert sees is kept to score on
        self.modules = {n: m for n, m in fused_experts(layer).items() if foldable(m)}
        self.groups: dict[tuple[str, int], awq.Group] = {}
        self._handles = [
            module.down_proj_input_quantizer.register_forward_pre_hook(
                lambda _q, args, n=name, m=module: self._observe(n, m, args[0])
            )
            for name, module in self.modules.items()
        ]

    def _observe(self, name: str, module: Any, x: torch.Tensor) -> None:
        if not x.numel():
            return
        expert = int(module._current_expert_idx)
        group = self.groups.get((name, expert))
        if group is None:
            member = _DownProj(
                module.down_proj.data[expert], module.down_proj_weight_quantizers[expert], module.down_proj_input_quantizer
            )
            group = self.groups[(name, expert)] = awq.Group(
                [(f"{name}.down_proj[{expert}]", member)], fused=False, keep_every=self.keep
            )
        group.observe(x)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _recalibrate(quantizer: Any, weight: torch.Tensor) -> None:
    """Max calibration of one expert's weight quantizer from its folded weight alone: block scales,
    and NVFP4's global scale (the largest block maximum, as ModelOpt promotes it)."""
    from modelopt.torch.quantization.model_calib import max_calibrate

    quantizer.reset_amax()
    max_calibrate(quantizer, lambda q: q(weight))
    if getattr(quantizer, "global_amax", None) is not None:
        quantizer.global_amax = quantizer.amax.float().amax()


@torch.no_grad()
def search_and_fold(groups: ExpertGroups, alpha_step: float, scored_tokens: int, prefix: str) -> Factors:
    """Each expert's best scale, folded: ``up`` rows times ``c = 1 / s``, ``down`` columns times ``s``.
    Returns what that did, per fused tensor (``prefix`` + module + ``.down_proj``: ``in_scale``
    [experts, intermediate]; ``.gate_up_proj``: ``out_scale`` [experts, 2 × intermediate], ones where
    nothing changed), in ``fold``'s terms. A folded expert's weight quantizers are calibrated again."""
    factors: Factors = {}
    for name, module in groups.modules.items():
        experts, _, inner = module.down_proj.shape
        in_scale = torch.ones(experts, inner)
        amax = module.down_proj_input_quantizer.amax
        ranges = []
        for expert in range(experts):
            group = groups.groups.get((name, expert))
            if group is None:
                continue  # no token reached it: it keeps max calibration and adds no input range
            best = awq.choose(group, alpha_step, scored_tokens)
            c = 1.0 / group.scales[best]
            assert group.amax is not None
            ranges.append((group.amax * c).amax())
            if best == "none":
                continue
            up = module.gate_up_proj.data[expert, inner:]
            up.copy_((up.float() * c.to(up.device).reshape(-1, 1)).to(up.dtype))
            down = module.down_proj.data[expert]
            down.copy_((down.float() / c.to(down.device).reshape(1, -1)).to(down.dtype))
            in_scale[expert] = c
            for weight, quantizer in (
                (module.gate_up_proj.data[expert], module.gate_up_proj_weight_quantizers[expert]),
                (down, module.down_proj_weight_quantizers[expert]),
            ):
                _recalibrate(quantizer, weight)
        if amax is not None and ranges:
            module.down_proj_input_quantizer.amax = torch.stack(ranges).amax().to(amax.device, amax.dtype)
        if not torch.equal(in_scale, torch.ones_like(in_scale)):
            factors[f"{prefix}{name}.down_proj"] = {"in_scale": in_scale}
            factors[f"{prefix}{name}.gate_up_proj"] = {"out_scale": torch.cat([torch.ones_like(in_scale), in_scale], 1)}
    return factors
