"""A PEFT LoRA adapter's files, checked without torch: its config, its safetensors header, its
LoRA matrices against the base's weight shapes.

The service checks an uploaded adapter with these before it stores anything, and the merge
applies the same rules, so an adapter that registers is one the merge can apply.

``rank_pattern`` / ``alpha_pattern`` keys are regular expressions (PEFT matches them against the
end of a module's dotted name). Python's ``re`` backtracks exponentially on patterns such as
``(.*.*)*Z``, holding the GIL for hours; they are matched with the ``regex`` engine, which
handles those in linear time, under a per-match timeout for whatever is left.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import regex

from fp4prep.text import clip, excerpt

from .errors import UserError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.[^.]+)?(\.weight)?$"
)
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")
PATTERN_MAX_CHARS = 256
PATTERN_MAX_KEYS = 4096
MATCH_TIMEOUT_SECONDS = 0.05
# safetensors itself refuses headers over 100 MB; a LoRA adapter's header is a few hundred KB.
HEADER_MAX_BYTES = 100 * 1000 * 1000
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_INDEX = re.compile(r"\.\d+(?=\.|$)")

Shape = tuple[int, ...]


# --- the config ---------------------------------------------------------------------------------------


def _pattern(field: str, key: str) -> Any:
    try:
        return regex.compile(rf"(?:.*\.)?(?:{key})$")
    except (regex.error, OverflowError, RecursionError) as exc:
        raise UserError(f"{CONFIG_NAME}: {field} key {excerpt(key)} is not a valid regular expression ({exc})") from None


def pattern_value(config: dict[str, Any], field: str, module: str, default: Any) -> Any:
    """The value ``config[field]`` gives ``module`` (the first key that matches), else ``default``."""
    for key, value in (config.get(field) or {}).items():
        try:
            if _pattern(field, key).match(module, timeout=MATCH_TIMEOUT_SECONDS):
                return value
        except TimeoutError:
            raise UserError(
                f"{CONFIG_NAME}: {field} key {excerpt(key)} takes too long to match module names "
                "(a pattern that backtracks); name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
            ) from None
    return default


def _positive_number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{CONFIG_NAME}: {where} must be a positive number, not {excerpt(value)}")


def check_config(config: Any, modules: Iterable[str]) -> None:
    """Refuse a config the merge can't apply, naming the field: not LoRA, DoRA, bad ranks or scales,
    and rank/alpha patterns that don't compile or take too long against the adapter's own modules."""
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
            _pattern(field, key)
        for module in names:
            pattern_value(config, field, module, None)


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
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{name} is not a safetensors file: its header is not JSON ({clip(str(exc), 80)})") from None
    if not isinstance(header, dict):
        raise UserError(f"{name} is not a safetensors file: its header is not an object")
    header.pop("__metadata__", None)
    shapes: dict[str, Shape] = {}
    spans = []
    for key, entry in header.items():
        where = f"{name}: tensor {excerpt(key)}"
        if not isinstance(entry, dict) or entry.get("dtype") not in FLOAT_BYTES:
            raise UserError(f"{where} is not a floating-point tensor (dtype {excerpt(entry.get('dtype') if isinstance(entry, dict) else entry)})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise UserError(f"{where} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise UserError(f"{where} has no valid data_offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * FLOAT_BYTES[entry["dtype"]]:
            raise UserError(f"{where}: data_offsets {offsets} don't hold a {entry['dtype']} tensor of shape {shape}")
        shapes[key] = tuple(shape)
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise UserError(f"{name}: tensors overlap or leave gaps at byte {begin:,} of the data")
        position = end
    if position != size - 8 - length:
        raise UserError(f"{name}: its tensors take {position:,} bytes, the file holds {size - 8 - length:,} after the header")
    return prefix + raw, shapes


# --- the LoRA matrices against the base -----------------------------------------------------------------


def normalize(name: str) -> str:
    """A tensor name with its layer and expert indices as ``*``: ``model.layers.*.mlp.down_proj.weight``."""
    return _INDEX.sub(".*", name)


def layer_index(name: str) -> int | None:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def lora_pairs(shapes: dict[str, Shape]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The LoRA matrices per module (``{module: {kind: stored name}}``) and the tensors saved whole
    (``modules_to_save``: base name -> stored name)."""
    pairs: dict[str, dict[str, str]] = {}
    whole: dict[str, str] = {}
    for key in shapes:
        name = key.removeprefix(PEFT_PREFIX)
        match = LORA_KEY.match(name)
        if match:
            pairs.setdefault(match["module"], {})[match["kind"]] = key
        else:
            whole[name.replace(".modules_to_save.default", "")] = key
    return pairs, whole


def lora_change_shape(a_shape: Shape, b_shape: Shape, *, embedding: bool, transposed: bool) -> tuple[Shape, Shape, tuple[int, int]]:
    """``(A's shape, B's shape, the change's shape)`` as the merge computes them."""
    if transposed:  # fan_in_fan_out: the stored matrices are B^T and A^T
        a_shape, b_shape = b_shape[::-1], a_shape[::-1]
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError("not 2-D")
    change = (a_shape[1], b_shape[0]) if embedding else (b_shape[0], a_shape[1])
    return a_shape, b_shape, change


def check_against_base(shapes: dict[str, Shape], config: dict[str, Any] | None, base: dict[str, Any] | None) -> None:
    """Every LoRA pair complete, 2-D and of one rank; with the base's weight shapes (``{"layers": N,
    "tensors": {normalized name: shape}}``), every change the shape of the weight it targets.

    Without the config (not read yet) either orientation of ``fan_in_fan_out`` is accepted here;
    the check runs again once it is.
    """
    pairs, whole = lora_pairs(shapes)
    if not pairs and not whole:
        raise UserError(f"{WEIGHTS_NAME} holds no LoRA weights")
    tensors = (base or {}).get("tensors") or {}
    layers = (base or {}).get("layers")
    orientations = [bool(config.get("fan_in_fan_out"))] if config is not None else [False, True]
    for module, parts in sorted(pairs.items()):
        embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if embedding else "lora_A")
        b = parts.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None:
            raise UserError(f"the adapter's {clip(module, 80)} has only one of its two LoRA matrices")
        target = f"{module}.weight"
        index = layer_index(target)
        if layers is not None and index is not None and index >= layers:
            raise UserError(f"the adapter targets {clip(module, 80)}, but the base has {layers} layers")
        expected = tensors.get(normalize(target)) if tensors else None
        if tensors and expected is None:
            raise UserError(f"the adapter targets {clip(module, 80)}, which the base model does not have")
        problems = []
        for transposed in orientations:
            try:
                a_shape, b_shape, change = lora_change_shape(shapes[a], shapes[b], embedding=embedding, transposed=transposed)
            except ValueError:
                problems.append(f"its LoRA matrices are not 2-D: {shapes[a]} and {shapes[b]}")
                continue
            if a_shape[0] != b_shape[1]:  # A is [r, in], B is [out, r] (embeddings too)
                problems.append(f"its LoRA matrices {shapes[a]} and {shapes[b]} have different ranks")
                continue
            if expected is not None and tuple(expected) != change:
                problems.append(
                    f"it makes a {change[0]}x{change[1]} change, but the base's {normalize(target)} is "
                    f"{expected[0]}x{expected[1]}: the adapter was trained on another base model"
                )
                continue
            problems = []
            break
        if problems:
            raise UserError(f"the adapter's {clip(module, 80)}: {problems[0]}")
    for name, stored in whole.items():
        expected = tensors.get(normalize(name)) if tensors else None
        if tensors and expected is None:
            raise UserError(f"the adapter saves {clip(name, 80)}, which the base model does not have")
        if expected is not None and tuple(expected) != shapes[stored]:
            raise UserError(
                f"the adapter's {clip(name, 80)} has shape {shapes[stored]}, the base's {tuple(expected)}: "
                "the adapter was trained on another base model"
            )


def base_weight_shapes(directory: Path) -> dict[str, Any]:
    """The table ``check_against_base`` takes, read from a base checkpoint's config and safetensors
    headers (the weights themselves are not read)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        layers = int(config.get("text_config", config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{directory.name}: no readable config.json with num_hidden_layers ({exc})") from None
    tensors: dict[str, list[int]] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory.name} holds no .safetensors weights")
    for path in files:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            tensors.setdefault(normalize(name), list(entry["shape"]))
    return {"layers": layers, "tensors": dict(sorted(tensors.items()))}
