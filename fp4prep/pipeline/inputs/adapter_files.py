"""A PEFT LoRA adapter's files, checked without torch: its config, its safetensors header, its
LoRA matrices against the base's weight shapes.

The service checks an uploaded adapter with these before it stores anything, and the merge plans
its work with the same ``lora_modules``, so an adapter that registers is one the merge can apply.

``rank_pattern`` / ``alpha_pattern`` keys are regular expressions (PEFT matches them against the
end of a module's dotted name). Python's ``re`` backtracks exponentially on patterns such as
``(.*.*)*Z``, holding the GIL for hours; they are matched with the ``regex`` engine, which
handles those in linear time, under a per-match timeout for whatever is left.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import regex

from fp4prep.text import clip, excerpt

from ..errors import UserError

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


class Patterns:
    """One ``rank_pattern`` / ``alpha_pattern`` field, its keys compiled once."""

    def __init__(self, config: dict[str, Any], field: str) -> None:
        self.field = field
        self.compiled = [(key, self._compile(key), value) for key, value in (config.get(field) or {}).items()]

    def _compile(self, key: str) -> Any:
        try:
            return regex.compile(rf"(?:.*\.)?(?:{key})$")
        except (regex.error, OverflowError, RecursionError) as exc:
            raise UserError(f"{CONFIG_NAME}: {self.field} key {excerpt(key)} is not a valid regular expression ({exc})") from None

    def value(self, module: str, default: Any) -> Any:
        """The value the first key matching ``module`` gives it, else ``default``."""
        for key, pattern, value in self.compiled:
            try:
                if pattern.match(module, timeout=MATCH_TIMEOUT_SECONDS):
                    return value
            except TimeoutError:
                raise UserError(
                    f"{CONFIG_NAME}: {self.field} key {excerpt(key)} takes too long to match module names "
                    "(a pattern that backtracks); name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
                ) from None
        return default


def pattern_value(config: dict[str, Any], field: str, module: str, default: Any) -> Any:
    """The value ``config[field]`` gives ``module`` (the first key that matches), else ``default``."""
    return Patterns(config, field).value(module, default)


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
        compiled = Patterns(config, field)
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


# PEFT's defaults for a config that leaves them out.
DEFAULT_R = 8
DEFAULT_ALPHA = 8
# The base's shape of a tensor by name, None where the base has no such tensor.
BaseShape = Callable[[str], "Shape | None"]


@dataclass(frozen=True)
class LoraPair:
    """One module's LoRA matrices, checked: both present, 2-D, of one rank."""

    module: str  # the module's name in the base model: model.layers.0.self_attn.q_proj
    a: str  # the stored names of A ([r, in]) and B ([out, r]); transposed under fan_in_fan_out
    b: str
    embedding: bool
    transposed: bool
    rank: int
    change: tuple[int, int]  # the shape of the change it makes: the target weight's
    scaling: float | None  # alpha / r (alpha / sqrt(r) under rsLoRA); None until the config is read

    @property
    def target(self) -> str:
        return f"{self.module}.weight"


def _pair(module: str, parts: dict[str, str], shapes: dict[str, Shape], transposed: bool) -> LoraPair:
    embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
    a = parts.get("lora_embedding_A" if embedding else "lora_A")
    b = parts.get("lora_embedding_B" if embedding else "lora_B")
    where = f"the adapter's {clip(module, 80)}"
    if a is None or b is None:
        raise UserError(f"{where} has only one of its two LoRA matrices")
    a_shape, b_shape = (shapes[b][::-1], shapes[a][::-1]) if transposed else (shapes[a], shapes[b])
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise UserError(f"{where}: its LoRA matrices are not 2-D: {shapes[a]} and {shapes[b]}")
    if a_shape[0] != b_shape[1]:  # A is [r, in], B is [out, r] (embeddings too)
        raise UserError(f"{where}: its LoRA matrices {shapes[a]} and {shapes[b]} have different ranks")
    change = (a_shape[1], b_shape[0]) if embedding else (b_shape[0], a_shape[1])
    return LoraPair(module, a, b, embedding, transposed, a_shape[0], change, None)


def _scaled(pair: LoraPair, config: dict[str, Any], ranks: Patterns, alphas: Patterns) -> LoraPair:
    """The pair with its scaling, if the config gives it the rank its matrices have (PEFT builds
    each module at the config's rank, and can't load matrices of another)."""
    r = ranks.value(pair.module, config.get("r", DEFAULT_R))
    if r != pair.rank:
        raise UserError(
            f"the adapter's {clip(pair.module, 80)}: its LoRA matrices have rank {pair.rank}, but {CONFIG_NAME} "
            f"gives it r={excerpt(r)}: the config and the weights were saved from different adapters"
        )
    alpha = float(alphas.value(pair.module, config.get("lora_alpha", DEFAULT_ALPHA)))
    scaling = alpha / math.sqrt(pair.rank) if config.get("use_rslora") else alpha / pair.rank
    return dataclasses.replace(pair, scaling=scaling)


def _fitting_pair(
    module: str, parts: dict[str, str], shapes: dict[str, Shape], orientations: list[bool], base_shape: BaseShape | None
) -> LoraPair | None:
    """The module's pair in the first orientation whose change fits the base (None: the base has
    no such target), or the first problem found."""
    problem = None
    for transposed in orientations:
        try:
            pair = _pair(module, parts, shapes, transposed)
        except UserError as exc:
            problem = problem or exc
            continue
        expected = base_shape(pair.target) if base_shape is not None else pair.change
        if expected is None:
            return None
        if tuple(expected) == pair.change:
            return pair
        problem = problem or UserError(
            f"the adapter's {clip(module, 80)}: it makes a {pair.change[0]}x{pair.change[1]} change, but the base's "
            f"{clip(pair.target, 80)} is {expected[0]}x{expected[1]}: the adapter was trained on another base model"
        )
    assert problem is not None
    raise problem


def lora_modules(
    shapes: dict[str, Shape], config: dict[str, Any] | None, base_shape: BaseShape | None = None
) -> tuple[list[LoraPair], dict[str, str]]:
    """The adapter's LoRA pairs and the tensors it saves whole (``modules_to_save``: base name ->
    stored name), checked as the merge will apply them.

    Every pair is complete, 2-D and of one rank; with the config, that rank is the one it gives the
    module, and each pair gets its scaling. With ``base_shape``, each change and each whole tensor
    has the shape of the base tensor it replaces or adds to. Without the config (not read yet),
    either orientation of ``fan_in_fan_out`` is accepted.
    """
    pairs, whole = lora_pairs(shapes)
    if not pairs and not whole:
        raise UserError(f"{WEIGHTS_NAME} holds no LoRA weights")
    orientations = [bool(config.get("fan_in_fan_out"))] if config is not None else [False, True]
    ranks, alphas = (Patterns(config, "rank_pattern"), Patterns(config, "alpha_pattern")) if config else (None, None)
    checked, missing = [], []
    for module, parts in sorted(pairs.items()):
        pair = _fitting_pair(module, parts, shapes, orientations, base_shape)
        if pair is None:
            missing.append(module)
            continue
        checked.append(_scaled(pair, config, ranks, alphas) if config is not None and ranks and alphas else pair)
    if missing:
        raise UserError(
            f"the adapter targets modules the base model does not have: {', '.join(clip(m, 80) for m in missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    for name, stored in whole.items():
        expected = base_shape(name) if base_shape is not None else shapes[stored]
        if expected is None:
            raise UserError(f"the adapter saves {clip(name, 80)}, which the base model does not have")
        if tuple(expected) != shapes[stored]:
            raise UserError(
                f"the adapter's {clip(name, 80)} has shape {shapes[stored]}, the base's {tuple(expected)}: "
                "the adapter was trained on another base model"
            )
    return checked, whole


def table_shapes(table: dict[str, Any]) -> BaseShape | None:
    """``base_shape`` from the table ``base_weight_shapes`` makes (shapes by normalized name and
    the number of layers); None when the table holds no shapes."""
    tensors, layers = table.get("tensors") or {}, table.get("layers")
    if not tensors:
        return None

    def shape(name: str) -> Shape | None:
        index = layer_index(name)
        if layers is not None and index is not None and index >= layers:
            raise UserError(f"the adapter targets {clip(name.removesuffix('.weight'), 80)}, but the base has {layers} layers")
        found = tensors.get(normalize(name))
        return tuple(found) if found is not None else None

    return shape


def check_against_base(shapes: dict[str, Shape], config: dict[str, Any] | None, base: dict[str, Any] | None) -> None:
    """``lora_modules`` against a base's table of weight shapes (``{"layers": N, "tensors":
    {normalized name: shape}}``), as an upload is checked before it is stored."""
    lora_modules(shapes, config, table_shapes(base or {}))


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
