"""The checkpoint's files checked on their own: the declared format written, every quantized
tensor present with finite non-zero scales, fused groups sharing one global scale, everything left
in BF16 declared so, and the size the format gives its tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import PipelineError
from ..formats import FORMATS, Format, declared
from ..formats.engine import engine_layers
from ..model.safetensors import TensorSource, directory_bytes, read_config

_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def structure(directory: Path, fmt: Format, bf16_bytes: int) -> list[str]:
    """Checks on the files alone; raises PipelineError naming the first problem."""
    config = read_config(directory)
    found = declared(config)
    if found.format != fmt:
        raise PipelineError(f"the checkpoint declares {found.format.name}, the recipe is {fmt.name}")
    source = TensorSource(directory)
    names = set(source.names())
    quantized = sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))
    if not quantized:
        raise PipelineError("the checkpoint holds no quantized tensors")
    checks = [f"format {fmt.name} declared and written ({len(quantized)} quantized modules)"]
    fp8 = _fp8_layers(config) if fmt.e2m1 else ()
    globals_ = {
        m: g
        for m in quantized
        if (g := _check_module(source, names, m, FORMATS["fp8"] if m.startswith(fp8) else fmt, found.layout.packed_name))
        is not None
    }
    if globals_:
        checks.append(_check_fused_globals(globals_))
    shared = _check_shared_inputs(source, names, set(quantized))
    if shared:
        checks.append(shared)
    checks.append(_check_exclusions(source, names, set(quantized), _excluded(config)))
    dense = {n: source.shape(n) for n in names if n.rpartition(".")[0] not in quantized}
    for module in quantized:
        packed = f"{module}.{found.layout.packed_name}"
        shape = source.shape(packed)
        dense[f"{module}.weight"] = (*shape[:-1], shape[-1] * 2) if source.stored_dtype(packed) == torch.uint8 else shape
    written, expected = directory_bytes(directory), fmt.checkpoint_bytes(dense)
    if not 0.9 * expected <= written <= 1.1 * expected + (4 << 20):
        raise PipelineError(f"checkpoint is {written:,} bytes, expected about {expected:,}")
    checks.append(f"size {written:,} bytes ({written / bf16_bytes:.2f}x the BF16 merged model)")
    return checks


def _check_module(source: TensorSource, names: set[str], module: str, fmt: Format, packed_name: str) -> float | None:
    """One quantized module's tensors; its global weight scale where the format has one. The packed
    weights are checked from the files' headers (dtype, shape): only the scales are read."""
    packed_key = f"{module}.{packed_name}"
    packed_dtype, packed_shape = source.stored_dtype(packed_key), source.shape(packed_key)
    scale = source.raw(f"{module}.weight_scale")
    if fmt.e2m1:
        if packed_dtype != torch.uint8:
            raise PipelineError(f"{module}: FP4 weights stored as {packed_dtype}, not packed uint8")
        if scale.shape[-1] * (fmt.block_size or 1) != packed_shape[-1] * 2:
            raise PipelineError(f"{module}: {scale.shape[-1]} block scales for {packed_shape[-1] * 2} values")
    elif packed_dtype != torch.float8_e4m3fn:
        raise PipelineError(f"{module}: FP8 weights stored as {packed_dtype}")
    if fmt.block_scale == "e8m0":
        if torch.any(scale == 255):
            raise PipelineError(f"{module}: an E8M0 scale is NaN (255)")
    elif not torch.isfinite(scale.float()).all() or torch.any(scale.float() == 0):
        raise PipelineError(f"{module}: scales must be finite and non-zero")
    if fmt.block_scale != "e4m3":
        return None
    for leaf in ("weight_scale_2", "input_scale") if fmt.activations_quantized else ("weight_scale_2",):
        key = f"{module}.{leaf}"
        if key not in names:
            raise PipelineError(f"{module}: {leaf} is missing")
        value = float(source.raw(key).float().reshape(-1)[0])
        if not (value > 0 and value < float("inf")):
            raise PipelineError(f"{module}: {leaf} is {value}")
    return float(source.raw(f"{module}.weight_scale_2").float())


def _fp8_layers(config: dict[str, Any]) -> tuple[str, ...]:
    """The module prefixes a mixed-precision config declares FP8 (a layer's routed experts are one)."""
    layers = (config.get("quantization_config") or {}).get("quantized_layers") or {}
    return tuple(
        f"{name}." if name.endswith("experts") else name
        for name, layer in layers.items()
        if isinstance(layer, dict) and str(layer.get("quant_algo", "")).upper().startswith("FP8")
    )


def _check_shared_inputs(source: TensorSource, names: set[str], quantized: set[str]) -> str:
    """The input scales of each layer the engine builds from several stored modules (q/k/v, gate/up,
    a layer's routed experts) must be equal: vLLM quantizes that layer's input with one scale, the
    largest stored, so a smaller one would be silently replaced."""
    layers = 0
    for group in sorted(set(engine_layers(quantized).values())):
        module = group[0]
        if len(group) < 2:
            continue
        leaf = next((f for f in ("input_scale", "input_global_scale") if f"{module}.{f}" in names), None)
        if leaf is None:
            continue
        values = {m: float(source.raw(f"{m}.{leaf}").float().max()) for m in group if f"{m}.{leaf}" in names}
        low, high = min(values, key=values.__getitem__), max(values, key=values.__getitem__)
        if values[low] != values[high]:
            raise PipelineError(
                f"{low} and {high} store different {leaf}s ({values[low]:g} and {values[high]:g}): the engine "
                f"runs them as one layer with one input scale, the larger"
            )
        layers += 1
    return f"one input scale per engine layer ({layers} fused or routed-expert layers)" if layers else ""


def _check_exclusions(source: TensorSource, names: set[str], quantized: set[str], excluded: list[str]) -> str:
    for module in quantized:
        if any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is quantized but listed as excluded")
    for name in names:
        module = name.removesuffix(".weight")
        matrix = name.endswith(".weight") and module not in quantized and len(source.shape(name)) == 2
        if matrix and not any(re.fullmatch(p, module) for p in excluded):
            raise PipelineError(f"{module} is left in BF16 but not listed as excluded")
    return f"every other 2-D weight is listed as excluded ({len(excluded)} patterns)"


def _excluded(config: dict[str, Any]) -> list[str]:
    """Patterns of the modules the config declares unquantized; a mixed-precision config lists the
    quantized ones instead (``quantized_layers``: a module, or a layer's routed experts whole), so
    there every module outside them is."""
    qc = config.get("quantization_config") or {}
    layers = qc.get("quantized_layers")
    if isinstance(layers, dict) and layers:
        covered = "|".join(re.escape(name) for name in layers)
        return [rf"(?!(?:{covered})(?:\..*)?$).*"]
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


def same_as_release(directory: Path, release: Path, bf16_bytes: int) -> list[str]:
    """A model written in its FP4 release's format checked against the release: the same
    quantization config, every stored tensor with the same name, dtype and shape, nothing added
    (the scales are the release's own); raises PipelineError naming the first difference."""
    ours, theirs = read_config(directory), read_config(release)
    if ours.get("quantization_config") != theirs.get("quantization_config"):
        raise PipelineError("the checkpoint's quantization_config differs from its release's")
    written, shipped = TensorSource(directory), TensorSource(release)
    if sorted(written.names()) != sorted(shipped.names()):
        extra, missing = set(written.names()) - set(shipped.names()), set(shipped.names()) - set(written.names())
        raise PipelineError(f"the checkpoint's tensors differ from its release's: added {sorted(extra)[:3]}, missing {sorted(missing)[:3]}")
    for name in shipped.names():
        if (written.stored_dtype(name), written.shape(name)) != (shipped.stored_dtype(name), shipped.shape(name)):
            raise PipelineError(f"{name}: stored as {written.stored_dtype(name)} {written.shape(name)}, the release has "
                                f"{shipped.stored_dtype(name)} {shipped.shape(name)}")
    size = directory_bytes(directory)
    return [
        f"the release's format ({theirs['quantization_config'].get('quant_method')}) and its {len(shipped.names())} tensors' "
        f"names, dtypes and shapes, nothing added",
        f"size {size:,} bytes ({size / bf16_bytes:.2f}x the BF16 merged model)",
    ]
