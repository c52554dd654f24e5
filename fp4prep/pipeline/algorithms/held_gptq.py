"""GPTQ on the block scales an FP4 release fixes: the rounding of a changed weight carries the change.

Rounding base + change to the nearest value on the release's grid snaps most of the change back: the
change is mostly under half a step and the base sits on the grid. GPTQ rounds a weight one input
column at a time and spreads each column's rounding error over the columns not yet rounded, through
the inverse Hessian of the weight's inputs, so that the layer's outputs rather than each weight stay
close to the BF16 merged model's: what one column's rounding drops, the columns after it take up,
and enough of it crosses a rounding boundary somewhere to show in the outputs. The release's block
(and global) scales are held, so the weights keep the grid the engine reads and the scales are
copied byte for byte.

The Hessians are those of the inputs each layer gets in the model as prepared so far, the layers
before it already rounded, and each weight is rounded towards what the BF16 merged model's layer
outputs from its own inputs: minimizing ``||X~ Q^T - X W^T||²`` (``X~`` the prepared model's inputs,
``X`` the merged model's) is GPTQ on ``X~``'s Hessian towards the weight ``W + W D^T X~ H~^-1``
(``D = X - X~``, GPTAQ's asymmetric calibration), so a layer also takes up the error the layers
before it left, where rounding on the merged model's inputs alone lets it pile up with depth. Within
a layer the weights are rounded stage by stage in the order the layer reads their inputs (q/k/v,
then o on what the rounded q/k/v give, then gate/up, then down; routed experts' inputs, then their
``act(gate) * up``): taken all at once from the merged weights, o would make up again for what q/k/v
already made up for, and the layer would overshoot (measured on the dense demo: KL on answers 0.85
all at once, 0.0079 by stages). Both models are walked one decoder layer at a time together
(``layer_walk.Walk``: each layer's weights read once, every stage's runs made with them held), and
the prepared model's hidden states are kept apart from the first layer the adapter changes. A
routed expert's come from the rows of the tokens its router sent it: the experts module's input for
its gate and up projections, ``act(gate) * up`` for its down projection (computed from the layer's
weights in place, as transformers' experts compute it). One layer's expert Hessians are gathered in
chunks that fit ``gptq.expert_hessian_bytes()``, one more pass of the layer's inputs per chunk.

What each changed weight kept is measured where its Hessian is: the share of the change's effect on
the outputs that the rounding kept, ``1 - ||(Q - W') X~||² / ||(B - W') X~||²`` with ``W'`` the goal
and ``B`` the release's weight (``1 - ||(Q - W) X||² / ||Δ X||²`` where no layer before drifted);
0 is the base's outputs, as rounding to nearest mostly gives, 1 the goal's. The codes are kept on disk, one
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
from .gptq import _Input, expert_hessian_bytes, gptq_rounding
from .gptq_update import BLOCK, CHUNK
from .held_inputs import Paired, Placed, Target, chunks, gather, placed, rounded_in
from .held_inputs import stages as staged
from .held_scales import nearest

# Coordinate-descent passes over every column after GPTQ (``descend``): each keeps improving the
# layer's outputs a little less; it stops early once a pass moves nothing.
DESCENT_PASSES = 4
# Round each layer on the prepared model's inputs towards the merged model's outputs (the module's
# docstring); False: on the merged model's inputs alone, as GPTQ does.
PREPARED_INPUTS = True
# GPTQ in activation order (the inputs with the largest Hessian diagonal rounded first): measured on
# the dense demo release's sentiment adapter, 60 conversations, it kept more of the change in weight
# space (0.353 -> 0.395) and in the tokens (top-1 on continuations 0.977 -> 1.000) at a lower KL.
ACTIVATION_ORDER = True
# A weight whose rounding kept less than this share of its change in the outputs is named in the report.
NOT_KEPT = 0.5


@dataclass
class Kept:
    """What separates a changed weight's base from its goal in the outputs (``||(B - W') X~||²`` per
    token), and what is left of it after GPTQ's rounding and after rounding to nearest
    (``||(Q - W') X~||²``)."""

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
            "rounding": f"by GPTQ on the release's block scales{' in activation order' if ACTIVATION_ORDER else ''}, "
            "then coordinate descent towards the BF16 merged "
            "model's outputs from the prepared model's inputs",
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


def round_release(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], source: BaseSource, merged: MergedWeights,
    codes_dir: Path, damp: float, stride: int, report: Callable[[float], None],
    each_layer: Callable[[torch.nn.Module], None] | None = None,
) -> HeldGptq:
    """GPTQ with the release's scales held on every changed quantized weight of ``merged``'s model
    (``model``: the BF16 merged model, streamed), walked over ``batches`` with the prepared model
    beside it (``PREPARED_INPUTS``); ``each_layer`` is handed every decoder layer while its
    weights are in, the merged model's (validation's first round rides along)."""
    by_layer, skipped = targets(source, merged, model)
    result = HeldGptq(codes_dir, nearest=skipped)
    codes_dir.mkdir(parents=True, exist_ok=True)
    walk = Walk(model, batches)
    model_of = merged.names.stored_of()
    # The prepared model's hidden states, from the first layer the adapter changes (the same as the
    # merged model's before it).
    prepared: list[torch.Tensor] | None = None
    for i, layer in enumerate(walk.layers):
        layer_targets = by_layer.get(i, [])
        if prepared is None and layer_targets and PREPARED_INPUTS:
            prepared = list(walk.hidden)
        paired = prepared is not None and prepared[0] is not walk.hidden[0]
        with held(list(layer.modules())):
            codes: dict[str, torch.Tensor] = {}
            values: list[Placed] = []  # the rounded weights, as the engine reads them, where the model holds them
            # gpt-oss's fused expert tensors (release, merged, steps), read once a layer
            fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            passes = chunks(layer_targets, expert_hessian_bytes(), 2 if paired else 1) or [[]]
            for n, chunk in enumerate(passes):
                stages = staged(model, layer, chunk, walk.hidden[0], walk.calls[0][i]) if paired and chunk else [chunk]
                for s, stage in enumerate(stages):
                    last = n == len(passes) - 1 and s == len(stages) - 1
                    hessians = gather(model, walk, i, stage, stride, last, prepared if paired else None, values)
                    for target in stage:
                        rounded, dequantized = _round(target, hessians.hessian(target), source, merged, damp, result, fused)
                        if prepared is not None:
                            values.append(placed(model, merged, model_of, target, dequantized))
                        if target.sliced:
                            shape = target.tensor.shape  # dense [experts, inputs, outputs]; codes by the stored rows
                            codes.setdefault(target.tensor.name, torch.zeros(shape[0], shape[2], shape[1], dtype=torch.int8))
                            codes[target.tensor.name][target.expert] = rounded.cpu()
                        else:
                            codes[target.tensor.name] = rounded
            if prepared is not None:  # the prepared model's states on through this layer, its weights rounded
                with rounded_in(values):
                    for b, call in enumerate(walk.calls):
                        prepared[b] = run_layer(layer, prepared[b], call[i])
            if each_layer is not None:
                each_layer(layer)
        if codes:
            save_file({k: v.contiguous() for k, v in codes.items()}, str(codes_dir / f"{i}.safetensors"))
        report((i + 1) / len(walk.layers))
    return result


def _round(
    target: Target, hessian: _Input | None, source: BaseSource, merged: MergedWeights, damp: float, result: HeldGptq,
    fused: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``target``'s E2M1 values ×2 (int8), rounded by GPTQ on the release's steps, and the weight they
    make (float32, by the stored rows); to nearest where its Hessian came from fewer tokens than its
    input width (GPTQ would fit the few it saw). With a ``Paired`` Hessian the rounding aims at the
    merged model's outputs from the prepared model's inputs. An expert of a fused tensor
    (``target.sliced``) is that expert's rows, the merged tensor read once into ``fused``."""
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
        values = nearest(weight, steps)
        return (values * 2).to(torch.int8), scale_blocks(values, steps)
    h = hessian.hessian.to(weight.device) / hessian.tokens
    goal = weight
    if isinstance(hessian, Paired) and hessian.cross is not None:
        goal = weight + _towards_merged(weight, h, hessian.cross.to(weight.device) / hessian.tokens, damp)
    # GPTQ from the merged weight, which sits next to the grid (rounding the goal from scratch, off
    # the grid everywhere, costs more than the goal gains); the descent then goes for the goal,
    # never making its objective worse.
    rounded = gptq_rounding(weight.clone(), h, steps, group, damp, ACTIVATION_ORDER)
    descend(rounded, goal, h, steps, DESCENT_PASSES)
    values = _values(rounded, steps)
    base = base.to(weight.device)
    near = scale_blocks(nearest(weight, steps), steps)
    change = _energy(goal - base, h)  # what the base's weight leaves of the goal (the change, where no layer before drifted)
    dequantized = scale_blocks(values, steps)
    result.kept[name] = Kept(change, _energy(dequantized - goal, h), _energy(near - goal, h), hessian.tokens)
    return (values * 2).round().to(torch.int8), dequantized


def _towards_merged(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, damp: float) -> torch.Tensor:
    """What to add to ``weight`` so that, on the prepared model's inputs (``hessian``: ``X~^T X~``),
    it gives the merged model's outputs from its own (``cross``: ``X~^T (X - X~)``), as nearly as
    least squares can: ``W D^T X~ (X~^T X~)^-1``, damped as GPTQ damps its Hessian."""
    h = hessian.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    return torch.linalg.solve(h, cross @ weight.T).T


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
