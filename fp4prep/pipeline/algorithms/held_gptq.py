"""GPTQ on the block scales an FP4 release fixes: the rounding of a changed weight carries the change.

Rounding base + change to the nearest value on the release's grid snaps most of the change back: the
change is mostly under half a step and the base sits on the grid. GPTQ rounds a weight one input
column at a time and spreads each column's rounding error over the columns not yet rounded, through
the inverse Hessian of the weight's inputs, so that the layer's outputs rather than each weight stay
close to the BF16 merged model's: what one column's rounding drops, the columns after it take up,
and enough of it crosses a rounding boundary somewhere to show in the outputs. The release's block
(and global) scales are held, so the weights keep the grid the engine reads and the scales are
copied byte for byte.

The Hessians are those of the BF16 merged model's inputs on the calibration corpus, walked one
decoder layer at a time (``layer_walk.Walk``: each layer's weights read once for every batch). A
routed expert's come from the rows of the tokens its router sent it: the experts module's input for
its gate and up projections, ``act(gate) * up`` for its down projection (computed from the layer's
weights in place, as transformers' experts compute it). One layer's expert Hessians are gathered in
chunks that fit ``gptq.expert_hessian_bytes()``, one more pass of the layer's inputs per chunk.

What each changed weight kept is measured where its Hessian is: the share of the change's effect on
the outputs (``||Δ X||²``) that the rounding kept, ``1 - ||(Q - W) X||² / ||Δ X||²``; 0 is the base's
outputs, as rounding to nearest mostly gives, 1 the merged weight's. The codes are kept on disk, one
file per layer, for the export to write.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..formats.numerics import quantize_to_scales, scale_blocks
from ..model.layer_walk import Walk, held, run_layer
from ..model.merge import MergedWeights
from ..model.releases import BaseSource, QuantizedTensor
from ..model.streaming import decoder_layers
from .gptq import BLOCK, CHUNK, _Input, expert_hessian_bytes, gptq_update
from .held_scales import nearest

# Coordinate-descent passes over every column after GPTQ (``descend``): each keeps improving the
# layer's outputs a little less; it stops early once a pass moves nothing.
DESCENT_PASSES = 4
# A weight whose rounding kept less than this share of its change in the outputs is named in the report.
NOT_KEPT = 0.5


@dataclass(frozen=True)
class Target:
    """A quantized weight of the release the adapter changes, and where the model computes with it."""

    tensor: QuantizedTensor
    module: str  # the model's module that multiplies by it (a linear layer or a routed experts module)
    expert: int | None  # for a routed experts module: the expert
    inner: bool  # it reads the expert's ``act(gate) * up`` (a down projection), not the module's input

    @property
    def key(self) -> tuple[str, int | None, bool]:
        return self.module, self.expert, self.inner

    @property
    def sliced(self) -> bool:
        """One expert of a tensor that stores every expert (gpt-oss's fused experts): rounded as
        that expert's rows."""
        return self.tensor.gpt_oss and self.expert is not None

    @property
    def columns(self) -> int:
        """The weight's inputs: gpt-oss's dense experts are ``[experts, inputs, outputs]``."""
        return self.tensor.shape[1] if self.tensor.gpt_oss else self.tensor.shape[-1]


@dataclass
class Kept:
    """A changed weight's change in the outputs (``||Δ X||²`` per token), and what is left of it as
    error after GPTQ's rounding and after rounding to nearest (``||(Q - W) X||²``)."""

    change: float
    gptq_error: float
    nearest_error: float
    tokens: int

    @property
    def kept(self) -> float:
        return 1 - self.gptq_error / self.change if self.change > 0 else 1.0

    @property
    def kept_nearest(self) -> float:
        return 1 - self.nearest_error / self.change if self.change > 0 else 1.0


@dataclass
class HeldGptq:
    """The codes and measures of every changed weight a walk rounded (``round_release``)."""

    codes_dir: Path
    kept: dict[str, Kept] = field(default_factory=dict)
    nearest: dict[str, str] = field(default_factory=dict)  # rounded to nearest, and why GPTQ could not round it

    def values(self, tensor: QuantizedTensor) -> torch.Tensor | None:
        """The E2M1 values GPTQ gave ``tensor`` (by the stored rows), or None where it rounded none."""
        path = self.codes_dir / f"{_layer_file(tensor.name)}.safetensors"
        if not path.is_file():
            return None
        codes = load_file(str(path)).get(tensor.name)
        return None if codes is None else codes.float() / 2

    def summary(self, threshold: float = NOT_KEPT) -> dict[str, Any]:
        """The change kept in the outputs over every weight GPTQ rounded (pooled by the change's
        size), the same for rounding to nearest, the weights that kept less than ``threshold`` of
        theirs, and those rounded to nearest."""
        change = sum(k.change for k in self.kept.values())
        return {
            "rounding": "by GPTQ on the release's block scales, then coordinate descent",
            "kept_in_outputs": 1 - sum(k.gptq_error for k in self.kept.values()) / change if change else None,
            "kept_in_outputs_nearest": 1 - sum(k.nearest_error for k in self.kept.values()) / change if change else None,
            "not_kept": {n: round(k.kept, 3) for n, k in sorted(self.kept.items()) if k.kept < threshold},
            "rounded_to_nearest": dict(sorted(self.nearest.items())),
        }


def _layer_file(name: str) -> str:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return found[1] if found else "other"


def targets(source: BaseSource, merged: MergedWeights, model: torch.nn.Module) -> tuple[dict[int, list[Target]], dict[str, str]]:
    """The changed quantized weights by decoder layer index, and those no Hessian can be gathered for
    (outside the decoder layers, or in a layout whose expert inputs are not followed here)."""
    layers_name, _ = decoder_layers(model)
    names = merged.names
    model_of = names.stored_of()
    by_layer: dict[int, list[Target]] = {}
    skipped: dict[str, str] = {}
    changed = set(merged.targets())
    for stored, tensor in source.quantized.items():
        if stored not in changed:
            continue
        model_name = model_of.get(stored, "")
        found = re.match(rf"{re.escape(layers_name)}\.(\d+)\.", model_name)
        module, _, attr = model_name.rpartition(".")
        part = names.expert_part(stored)
        if found is None:
            skipped[stored] = "outside the decoder layers"
        elif tensor.gpt_oss and attr in ("gate_up_proj", "down_proj"):
            inner = attr == "down_proj"
            by_layer.setdefault(int(found[1]), []).extend(Target(tensor, module, e, inner) for e in range(tensor.shape[0]))
        elif tensor.gpt_oss or model_name in names.transposed:
            skipped[stored] = "fused experts stored transposed: their inputs are not gathered"
        elif part is None and attr == "weight":
            by_layer.setdefault(int(found[1]), []).append(Target(tensor, module, None, False))
        elif part is not None and attr in ("gate_up_proj", "down_proj"):
            by_layer.setdefault(int(found[1]), []).append(Target(tensor, module, part[0], attr == "down_proj"))
        else:
            skipped[stored] = "a layout whose inputs are not gathered"
    return by_layer, skipped


class _LayerHessians:
    """Forward pre-hooks on one decoder layer gathering the Hessians of ``targets``' inputs."""

    def __init__(self, model: torch.nn.Module, targets: list[Target], stride: int) -> None:
        self.stride = stride
        self.inputs: dict[tuple[str, int | None, bool], _Input] = {}
        self._last: tuple[torch.Tensor, tuple[str, int | None, bool]] | None = None
        self._alias: dict[tuple[str, int | None, bool], tuple[str, int | None, bool]] = {}
        modules = dict(model.named_modules())
        self._handles = []
        plain = sorted({t.module for t in targets if t.expert is None})
        for name in plain:
            self._handles.append(modules[name].register_forward_pre_hook(lambda _m, args, n=name: self._linear(n, args[0])))
        experts: dict[str, list[tuple[int, bool]]] = {}
        for t in targets:
            if t.expert is not None:
                experts.setdefault(t.module, []).append((t.expert, t.inner))
        for name, wanted in experts.items():
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, n=name, w=wanted: self._experts(n, m, w, args, kwargs), with_kwargs=True
            ))

    def hessian(self, target: Target) -> _Input | None:
        return self.inputs.get(self._alias.get(target.key, target.key))

    def _linear(self, name: str, x: torch.Tensor) -> None:
        key = (name, None, False)
        if self._last is not None and self._last[0] is x:  # q/k/v, gate/up: one input, one Hessian
            self._alias[key] = self._last[1]
            return
        self.inputs.setdefault(key, _Input([name])).add(x, self.stride)
        self._last = (x, key)

    def _experts(self, name: str, module: Any, wanted: list[tuple[int, bool]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("hidden_states", "top_k_index", "router_indices")  # gpt-oss: router_indices
        values = [*args, *(kwargs[k] for k in names if k in kwargs)]
        hidden, index = values[0], values[1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        for expert in sorted({e for e, _ in wanted}):
            rows = (index.reshape(hidden.shape[0], -1) == expert).any(-1).nonzero().squeeze(-1)
            if not rows.numel():
                continue
            x = hidden[rows]
            if (expert, False) in wanted:
                self.inputs.setdefault((name, expert, False), _Input([name])).add(x, 1)
            if (expert, True) in wanted:
                if hasattr(module, "gate_up_proj_bias"):  # gpt-oss: [inputs, outputs], biases, interleaved gate and up
                    inner = module._apply_gate(x @ module.gate_up_proj[expert] + module.gate_up_proj_bias[expert])
                else:
                    gate, up = torch.nn.functional.linear(x, module.gate_up_proj[expert]).chunk(2, dim=-1)
                    inner = module.act_fn(gate) * up
                self.inputs.setdefault((name, expert, True), _Input([name])).add(inner, 1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


def _chunks(layer_targets: list[Target], budget: int) -> list[list[Target]]:
    """The layer's targets in passes of its inputs: as many routed experts a pass as their Hessians
    fit in ``budget`` bytes (at least one), the dense weights with the first."""
    dense = [t for t in layer_targets if t.expert is None]
    by_expert: dict[tuple[str, int | None], list[Target]] = {}
    for t in layer_targets:
        if t.expert is not None:
            by_expert.setdefault((t.module, t.expert), []).append(t)
    chunks: list[list[Target]] = []
    current: list[Target] = []
    used = 0
    for group in by_expert.values():
        size = sum(t.columns**2 * 4 for t in group)
        if current and used + size > budget:
            chunks.append(current)
            current, used = [], 0
        current += group
        used += size
    if current:
        chunks.append(current)
    if not chunks:
        return [dense] if dense else []
    chunks[0] = dense + chunks[0]  # the dense Hessians come with the first pass
    return chunks


def round_release(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], source: BaseSource, merged: MergedWeights,
    codes_dir: Path, damp: float, stride: int, report: Callable[[float], None],
    each_layer: Callable[[torch.nn.Module], None] | None = None,
) -> HeldGptq:
    """GPTQ with the release's scales held on every changed quantized weight of ``merged``'s model
    (``model``: the BF16 merged model, streamed), walked over ``batches``; ``each_layer`` is handed
    every decoder layer while its weights are in (validation's first round rides along)."""
    by_layer, skipped = targets(source, merged, model)
    result = HeldGptq(codes_dir, nearest=skipped)
    codes_dir.mkdir(parents=True, exist_ok=True)
    walk = Walk(model, batches)
    for i, layer in enumerate(walk.layers):
        with held(list(layer.modules())):
            codes: dict[str, torch.Tensor] = {}
            # gpt-oss's fused expert tensors (release, merged, steps), read once a layer
            fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            passes = _chunks(by_layer.get(i, []), expert_hessian_bytes()) or [[]]
            for n, chunk in enumerate(passes):
                hessians = _LayerHessians(model, chunk, stride)
                try:
                    if n == len(passes) - 1:
                        walk.layer(i, layer)
                    else:  # one more pass of the layer's inputs for this chunk of experts
                        for hidden, calls in zip(walk.hidden, walk.calls, strict=True):
                            run_layer(layer, hidden, calls[i])
                finally:
                    hessians.remove()
                for target in chunk:
                    rounded = _round(target, hessians.hessian(target), source, merged, damp, result, fused)
                    if target.sliced:
                        shape = target.tensor.shape  # dense [experts, inputs, outputs]; codes by the stored rows
                        codes.setdefault(target.tensor.name, torch.zeros(shape[0], shape[2], shape[1], dtype=torch.int8))
                        codes[target.tensor.name][target.expert] = rounded.cpu()
                    else:
                        codes[target.tensor.name] = rounded
            if each_layer is not None:
                each_layer(layer)
        if codes:
            save_file({k: v.contiguous() for k, v in codes.items()}, str(codes_dir / f"{i}.safetensors"))
        report((i + 1) / len(walk.layers))
    return result


def _round(
    target: Target, hessian: _Input | None, source: BaseSource, merged: MergedWeights, damp: float, result: HeldGptq,
    fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """``target``'s E2M1 values ×2 (int8), rounded by GPTQ on the release's steps; to nearest where
    its Hessian came from fewer tokens than its input width (GPTQ would fit the few it saw). An
    expert of a fused tensor (``target.sliced``) is that expert's rows, the merged tensor read once
    into ``fused``."""
    from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse

    tensor = target.tensor

    def read(name: str) -> torch.Tensor:
        return source.raw(name).to(merged.device)

    def base_and_merged() -> tuple[torch.Tensor, torch.Tensor]:
        # One read of the release's weight (as the engine dequantizes it, float32) for both.
        base = source.get(tensor.name, torch.float32, merged.device)
        return tensor.rows(base), tensor.rows(merged.merged(tensor.name, base=base))

    if target.sliced:
        if tensor.name not in fused:
            base, weights = base_and_merged()
            # gpt-oss is MXFP4: every dequantized value (E2M1 times a power of two) is exact in BF16.
            fused[tensor.name] = (base.to(torch.bfloat16), weights, tensor.steps(read))
        bases, weights, all_steps = fused[tensor.name]
        base, weight = bases[target.expert].float(), weights[target.expert].float()
        steps, name = all_steps[target.expert].to(weight.device), f"{tensor.name} (expert {target.expert})"
    else:
        base, weight = base_and_merged()
        weight, name = weight.float(), tensor.name
        steps = tensor.steps(read).to(weight.device)
    group = weight.shape[-1] // steps.shape[-1]
    why = _why_not_gptq(hessian, weight.shape[-1], group)
    if why or hessian is None or hessian.hessian is None:
        result.nearest[name] = why
        return (nearest(weight, steps) * 2).to(torch.int8)
    h = hessian.hessian.to(weight.device) / hessian.tokens
    rounded = weight.clone()
    gptq_update(rounded, compute_hessian_inverse(h, weight, damp), steps, group, BLOCK)
    descend(rounded, weight, h, steps, DESCENT_PASSES)
    values = _values(rounded, steps)
    base = base.to(weight.device)
    near = scale_blocks(nearest(weight, steps), steps)
    change = _energy(weight - base, h)
    result.kept[name] = Kept(
        change, _energy(scale_blocks(values, steps) - weight, h), _energy(near - weight, h), hessian.tokens
    )
    return (values * 2).round().to(torch.int8)


def _why_not_gptq(hessian: _Input | None, columns: int, group: int) -> str:
    """Why GPTQ can't round a weight of ``columns`` inputs in blocks of ``group`` (empty: it can)."""
    if hessian is None or hessian.hessian is None:
        return "no calibration token reached it"
    if hessian.tokens < columns:
        return f"too few calibration tokens reached it ({hessian.tokens} for {columns} inputs)"
    return f"blocks of {group} values" if BLOCK % group or group % CHUNK else ""


@torch.no_grad()
def descend(rounded: torch.Tensor, weight: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor, passes: int) -> None:
    """Coordinate descent on ``||(Q - W) X||²`` over the grid, in place on ``rounded`` (``Q``): each
    column in turn moved to the grid value nearest its best value with every other column held,
    ``q_j - ((Q - W) H)_j / H_jj`` (each row's objective is a quadratic in its ``q_j``, so the nearest
    grid value is the best one and no step makes it worse). GPTQ rounds each column once, against the
    columns before it only; this revisits every column against all the others, as QuantEase does."""
    columns = rounded.shape[-1]
    group = columns // steps.shape[-1]
    residual = (rounded - weight) @ hessian  # (Q - W) H, kept up to date column by column
    diagonal = hessian.diagonal()
    for _ in range(passes):
        moved = 0
        for j in range(columns):
            if diagonal[j] <= 0:
                continue
            best = rounded[:, j] - residual[:, j] / diagonal[j]
            new = quantize_to_scales(best, steps[:, j // group])
            delta = new - rounded[:, j]
            if bool(delta.any()):
                rounded[:, j] = new
                residual.addr_(delta, hessian[j])
                moved += 1
        if not moved:
            return


def _values(rounded: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of a weight GPTQ left on its blocks' grids (a zero or non-finite step: zeros)."""
    blocks = rounded.reshape(*steps.shape, -1)
    step = steps.unsqueeze(-1)
    bad = (step == 0) | ~torch.isfinite(step)
    values = torch.where(bad, torch.zeros_like(blocks), blocks / torch.where(bad, torch.ones_like(step), step))
    return values.reshape(rounded.shape)


def _energy(error: torch.Tensor, hessian: torch.Tensor) -> float:
    """``||error X||²`` per token: ``tr(E H Eᵀ)`` with ``H = XᵀX / tokens``."""
    return float(((error @ hessian) * error).sum())
