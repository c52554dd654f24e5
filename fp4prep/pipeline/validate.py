"""Proving a checkpoint sound before anyone registers it.

Structure (every quantized tensor present, finite non-zero scales, the declared format written,
fused groups sharing scales, size as expected), the share of the adapter's change that survived,
and the bar the recipe sets on those and on behaviour (``parity``) against the BF16 merged model.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import torch

from .checkpoint import TensorSource, directory_bytes, read_config
from .config import ParityReport, RetentionReport
from .errors import PipelineError
from .reader import DequantizedWeights, detect_layout
from .recipes import Recipe, Thresholds
from .weights import MergedWeights

_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def structure(directory: Path, recipe: Recipe, bf16_bytes: int) -> list[str]:
    """Checks on the files alone; raises PipelineError naming the first problem."""
    config = read_config(directory)
    layout = detect_layout(config)
    if layout.scheme != recipe.name:
        raise PipelineError(f"the checkpoint declares {layout.scheme}, the recipe is {recipe.name}")
    source = TensorSource(directory)
    names = set(source.names())
    quantized = sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))
    if not quantized:
        raise PipelineError("the checkpoint holds no quantized tensors")
    checks = [f"format {layout.scheme} declared and written ({len(quantized)} quantized modules)"]
    globals_: dict[str, float] = {}
    for module in quantized:
        packed = source.raw(f"{module}.{layout.packed_name}")
        scale = source.raw(f"{module}.weight_scale")
        if recipe.name in ("nvfp4", "mxfp4"):
            if packed.dtype != torch.uint8:
                raise PipelineError(f"{module}: FP4 weights stored as {packed.dtype}, not packed uint8")
            block = recipe.block_size or 1
            if scale.shape[-1] * block != packed.shape[-1] * 2:
                raise PipelineError(
                    f"{module}: {scale.shape[-1]} block scales for {packed.shape[-1] * 2} values"
                )
        elif packed.dtype != torch.float8_e4m3fn:
            raise PipelineError(f"{module}: FP8 weights stored as {packed.dtype}")
        if recipe.name == "mxfp4":
            if torch.any(scale == 255):
                raise PipelineError(f"{module}: an E8M0 scale is NaN (255)")
        elif not torch.isfinite(scale.float()).all() or torch.any(scale.float() == 0):
            raise PipelineError(f"{module}: scales must be finite and non-zero")
        if recipe.name == "nvfp4":  # always ModelOpt's layout
            for leaf in ("weight_scale_2", "input_scale") if recipe.activations_quantized else ("weight_scale_2",):
                key = f"{module}.{leaf}"
                if key not in names:
                    raise PipelineError(f"{module}: {leaf} is missing")
                value = float(source.raw(key).float().reshape(-1)[0])
                if not (value > 0 and value < float("inf")):
                    raise PipelineError(f"{module}: {leaf} is {value}")
            globals_[module] = float(source.raw(f"{module}.weight_scale_2").float())
    if globals_:
        checks.append(_check_fused_globals(globals_))
    excluded = _excluded(config)
    for module in quantized:
        if any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is quantized but listed as excluded")
    quantized_set = set(quantized)
    for name in names:
        module = name.removesuffix(".weight")
        unquantized_matrix = (
            name.endswith(".weight") and module not in quantized_set and len(source.shape(name)) == 2
        )
        if unquantized_matrix and not any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is left in BF16 but not listed as excluded")
    checks.append(f"every other 2-D weight is listed as excluded ({len(excluded)} patterns)")
    written = directory_bytes(directory)
    expected = _expected_bytes(source, quantized, recipe, layout.packed_name)
    if not 0.9 * expected <= written <= 1.1 * expected + (4 << 20):
        raise PipelineError(f"checkpoint is {written:,} bytes, expected about {expected:,}")
    checks.append(f"size {written:,} bytes ({written / bf16_bytes:.2f}x the BF16 merged model)")
    return checks


def _excluded(config: dict[str, Any]) -> list[str]:
    qc = config.get("quantization_config") or {}
    patterns = []
    for p in qc.get("ignore") or qc.get("exclude_modules") or []:
        patterns.append(p[3:] if p.startswith("re:") else re.escape(p).replace(r"\*", ".*"))
    return patterns


def _check_fused_globals(globals_: dict[str, float]) -> str:
    shared = 0
    for module in globals_:
        parent, _, leaf = module.rpartition(".")
        for group in _FUSED_GROUPS:
            if leaf == group[0]:
                values = {g: globals_.get(f"{parent}.{g}") for g in group}
                present = {g: v for g, v in values.items() if v is not None}
                if len(set(present.values())) > 1:
                    raise PipelineError(
                        f"{parent}: fused {'/'.join(group)} have different global scales {present}"
                    )
                shared += 1
    return f"fused groups share one global scale ({shared} groups)"


def _expected_bytes(source: TensorSource, quantized: list[str], recipe: Recipe, packed_name: str) -> int:
    total = 0
    quantized_set = set(quantized)
    for name in source.names():
        module, _, leaf = name.rpartition(".")
        shape = source.shape(name)
        numel = 1
        for d in shape:
            numel *= d
        if module in quantized_set:
            if leaf == packed_name:
                values = numel * (2 if recipe.name != "fp8" else 1)
                total += int(values * recipe.weight_bits / 8)
            elif leaf not in ("weight_scale",):
                total += 4 * numel
        else:
            total += 2 * numel
    return total


def retention(
    merged: MergedWeights, dequantized: DequantizedWeights, factors: dict[str, dict[str, torch.Tensor]] | None = None
) -> RetentionReport | None:
    """Least-squares coefficient of (dequantized - base) on (merged - base), per changed tensor.

    About 1 when the adapter's change survived quantization, near 0 when it snapped back to the
    base (as it does when an adapter is merged into weights already in FP4). One tensor at a time.
    ``factors`` undoes what folding AWQ's scales did to a stored weight (see ``quantize``).
    """
    per_tensor: dict[str, float] = {}
    num = den = 0.0
    for name in merged.targets():
        if name not in dequantized:
            continue
        b = merged.source.get(name, torch.float32, merged.device)
        delta = merged.merged(name).float() - b
        dd = float((delta * delta).sum())
        if dd == 0.0:
            continue
        stored = dequantized.stored(name).to(b.device, torch.float32)
        folded = (factors or {}).get(name, {})
        if "in_scale" in folded:
            stored = stored * folded["in_scale"].to(b.device).reshape(1, -1)
        if "out_scale" in folded:
            stored = stored / folded["out_scale"].to(b.device).reshape(-1, 1)
        change = stored - b
        dc = float((delta * change).sum())
        per_tensor[name] = dc / dd
        num += dc
        den += dd
    if not per_tensor:
        return None
    values = list(per_tensor.values())
    return RetentionReport(
        pooled=num / den, minimum=min(values), median=statistics.median(values), per_tensor=per_tensor
    )


def misses(
    thresholds: Thresholds, parity: ParityReport, reload_diff: float, kept: RetentionReport | None
) -> list[str]:
    """Every way the checkpoint falls short of its recipe's bar, as sentences."""
    failures = []
    if reload_diff > thresholds.reload_max_logit_diff:
        failures.append(
            f"the reloaded checkpoint's logits differ from the calibrated model's by {reload_diff:.3f} "
            f"(at most {thresholds.reload_max_logit_diff})"
        )
    if parity.continuation_top1 < thresholds.continuation_top1:
        failures.append(
            f"top-1 agreement on the BF16 model's own continuations {parity.continuation_top1:.3f} "
            f"< {thresholds.continuation_top1}"
        )
    if parity.answer_kl > thresholds.answer_kl:
        failures.append(f"mean KL on the assistant turns {parity.answer_kl:.3f} > {thresholds.answer_kl}")
    if parity.identical_greedy < thresholds.identical_greedy:
        failures.append(
            f"identical greedy share {parity.identical_greedy:.3f} < {thresholds.identical_greedy}"
        )
    if kept is not None and kept.pooled < thresholds.adapter_retention:
        failures.append(
            f"only {kept.pooled:.2f} of the adapter's change survived quantization "
            f"(at least {thresholds.adapter_retention}): was the base already quantized?"
        )
    return failures


def summary(parity: ParityReport, reload_diff: float, kept: RetentionReport | None) -> list[str]:
    return [
        f"reload matches the calibrated model (max logit difference {reload_diff:.4f})",
        f"parity on answers: top-1 {parity.answer_top1:.3f}, KL {parity.answer_kl:.4f}; on the BF16 model's "
        f"continuations: top-1 {parity.continuation_top1:.3f}; identical greedy {parity.identical_greedy:.2f}",
        f"parity over whole conversations: top-1 {parity.top1_agreement:.3f}, KL {parity.mean_kl:.4f}",
    ] + ([f"adapter change retained: {kept.pooled:.3f} pooled"] if kept else [])
