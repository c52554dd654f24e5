"""A PEFT LoRA adapter's files, checked without torch: its config, its safetensors header, its
LoRA matrices against the base's weight shapes (``lora_targets``; ``base_weight_shapes``, which
builds the base's table from a checkpoint, asks transformers for the model's names).

The service checks an uploaded adapter with these before it stores anything, and the merge plans
its work with the same ``lora_targets.lora_modules``, so an adapter that registers is one the merge
can apply.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from fp4prep.text import clip, excerpt, parse_json

from ..errors import UserError
from .lora_patterns import (
    CONFIG_NAME,
    PATTERN_FIELDS,
    PATTERN_MAX_CHARS,
    PATTERN_MAX_KEYS,
    PATTERN_MAX_SECONDS,
    PATTERN_MAX_STEPS,
    Patterns,
    match_budget,
    pattern_value,
)
from .lora_targets import WEIGHTS_NAME, Shape, lora_modules, lora_pairs, normalize, table_base

__all__ = [
    "CONFIG_NAME", "PATTERN_MAX_SECONDS", "PATTERN_MAX_STEPS", "WEIGHTS_NAME", "Shape", "base_weight_shapes",
    "check_against_base", "check_config", "lora_pairs", "match_budget", "pattern_value", "read_header",
]

# safetensors itself refuses headers over 100 MB; a LoRA adapter's header is a few hundred KB.
HEADER_MAX_BYTES = 100 * 1000 * 1000
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


# --- the config ---------------------------------------------------------------------------------------


# Ranks and alphas are small; a bound keeps a 4000-digit integer from overflowing float arithmetic.
NUMBER_MAX = 1_000_000


def _positive_number(value: Any, where: str) -> None:
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not finite or value <= 0:
        raise UserError(f"{CONFIG_NAME}: {where} must be a positive number, not {excerpt(value)}")
    if value > NUMBER_MAX:
        raise UserError(f"{CONFIG_NAME}: {where} is {excerpt(value)}; at most {NUMBER_MAX:,} is accepted")


def check_config(config: Any, modules: Iterable[str], max_pattern_steps: int = PATTERN_MAX_STEPS) -> None:
    """Refuse a config the merge can't apply, naming the field: not LoRA, DoRA, bad ranks or scales,
    and rank/alpha patterns that don't compile or take too long against the adapter's own modules
    (more than ``max_pattern_steps`` lookups and matches)."""
    if not isinstance(config, dict):
        raise UserError(f"{CONFIG_NAME} must hold a JSON object")
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise UserError(f"{CONFIG_NAME} does not describe a LoRA adapter (peft_type {excerpt(config.get('peft_type'))})")
    if config.get("use_dora"):
        raise UserError("DoRA adapters are not supported: train a plain LoRA adapter")
    for field in ("r", "lora_alpha"):
        if field in config:
            _positive_number(config[field], field)
    names = list(modules)
    for field in PATTERN_FIELDS:
        patterns = config.get(field)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise UserError(f"{CONFIG_NAME}: {field} must be an object of module pattern -> number")
        if len(patterns) > PATTERN_MAX_KEYS:
            raise UserError(f"{CONFIG_NAME}: {field} has {len(patterns):,} keys; at most {PATTERN_MAX_KEYS:,} are accepted")
        for key, value in patterns.items():
            if len(key) > PATTERN_MAX_CHARS:
                raise UserError(f"{CONFIG_NAME}: {field} key {excerpt(key)} is longer than {PATTERN_MAX_CHARS} characters")
            _positive_number(value, f"{field}[{excerpt(key)}]")
        compiled = Patterns.of(config, field)
        compiled.check_cost(names, max_pattern_steps)
        for module in names:
            compiled.value(module, None)


# --- the weights' header -------------------------------------------------------------------------------


def read_header(stream: IO[bytes], size: int, name: str = WEIGHTS_NAME) -> tuple[bytes, dict[str, Shape]]:
    """Read and check a safetensors file's header from ``stream`` (positioned at its start).

    Returns the bytes read (to write them on) and each tensor's shape. The tensors must be floats
    that exactly tile the ``size - 8 - header`` bytes that follow, so the file holds nothing else.
    """
    prefix = stream.read(8)
    if len(prefix) < 8:
        raise UserError(f"{name} is too short to be a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > HEADER_MAX_BYTES or 8 + length > size:
        raise UserError(f"{name} is not a safetensors file: its header claims {length:,} bytes of a {size:,}-byte file")
    raw = stream.read(length)
    if len(raw) < length:
        raise UserError(f"{name} is truncated inside its header")
    try:
        header = parse_json(raw)
    except ValueError as exc:
        raise UserError(f"{name} is not a safetensors file: its header is not JSON ({clip(str(exc), 80)})") from None
    if not isinstance(header, dict):
        raise UserError(f"{name} is not a safetensors file: its header is not an object")
    header.pop("__metadata__", None)
    shapes: dict[str, Shape] = {}
    spans = []
    for key, entry in header.items():
        where = f"{name}: tensor {excerpt(key)}"
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or dtype not in FLOAT_BYTES:
            raise UserError(f"{where} is not a floating-point tensor (dtype {excerpt(entry.get('dtype') if isinstance(entry, dict) else entry)})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)):
            raise UserError(f"{where} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise UserError(f"{where} has no valid data_offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * FLOAT_BYTES[dtype]:
            raise UserError(f"{where}: data_offsets {excerpt(offsets, 80)} don't hold a {dtype} tensor of shape {excerpt(shape, 80)}")
        shapes[key] = tuple(shape)
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise UserError(f"{name}: tensors overlap or leave gaps at byte {clip(f'{begin:,}', 40)} of the data")
        position = end
    if position != size - 8 - length:
        raise UserError(f"{name}: its tensors take {position:,} bytes, the file holds {size - 8 - length:,} after the header")
    return prefix + raw, shapes


def check_against_base(
    shapes: dict[str, Shape], config: dict[str, Any] | None, base: dict[str, Any] | None,
    max_pattern_steps: int = PATTERN_MAX_STEPS,
) -> None:
    """``lora_modules`` against a base's table of weight shapes (``{"layers": N, "tensors":
    {normalized name: shape}}``), as an upload is checked before it is stored."""
    lora_modules(shapes, config, table_base(base or {}), max_pattern_steps)


def base_weight_shapes(directory: Path) -> dict[str, Any]:
    """The table ``check_against_base`` takes, read from a base checkpoint's config and safetensors
    headers (the weights themselves are not read): every tensor's shape by its stored name and by
    the name transformers' model of the config gives it (routed experts fused), layer and expert
    indices as ``*``, and which 3-D expert tensors are stored [experts, in, out]."""
    from ..model.experts import CheckpointNames
    from ..model.releases import BaseSource

    try:
        config = json.loads((directory / "config.json").read_text())
        layers = int(config.get("text_config", config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{directory.name}: no readable config.json with num_hidden_layers ({exc})") from None
    # Headers only: an FP4 release's weights by their dense names and shapes, as the merge reads them.
    source = BaseSource(directory)
    stored = {name: list(source.shape(name)) for name in source.names()}
    names = CheckpointNames(config, list(stored))
    tensors: dict[str, list[int]] = {}
    for name, shape in [*stored.items(), *((n, list(s)) for n, s in names.shapes.items())]:
        tensors.setdefault(normalize(name), shape)
    return {
        "layers": layers,
        "tensors": dict(sorted(tensors.items())),
        "transposed": sorted({normalize(n) for n in names.transposed}),
    }
