"""An adapter's LoRA matrices matched to the base model's tensors: which tensor each pair changes,
with which rank and scaling (``lora_patterns`` reads ``rank_pattern`` / ``alpha_pattern``),
checked by shape alone (no torch), as the upload and the merge both do.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fp4prep.text import clip, excerpt

from ..errors import UserError
from .lora_patterns import CONFIG_NAME, Patterns

WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.[^.]+)?(\.weight)?$"
)
_INDEX = re.compile(r"\.\d+(?=\.|$)")

Shape = tuple[int, ...]


# --- the LoRA matrices against the base -----------------------------------------------------------------


def normalize(name: str) -> str:
    """A tensor name with its layer and expert indices as ``*``: ``model.layers.*.mlp.down_proj.weight``."""
    return _INDEX.sub(".*", name)


# An index of more digits than this is past any model's layers or experts (and more than 4,300
# digits would not even convert).
INDEX_DIGITS = 9


def _index(pattern: str, name: str) -> int | None:
    match = re.search(pattern, name)
    if match is None:
        return None
    digits = match.group(1)
    return int(digits) if len(digits) <= INDEX_DIGITS else 10**INDEX_DIGITS


def layer_index(name: str) -> int | None:
    return _index(r"\.layers\.(\d+)\.", name)


def expert_index(name: str) -> int | None:
    """A per-expert module's expert (``...experts.3.w1``), or None."""
    return _index(r"\.experts\.(\d+)\.", name)


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
BASE_LAYER = ".base_layer"


class BaseTensors:
    """A base model's tensors as an adapter is checked against them: each one's shape by the name
    the transformers model uses (``mlp.experts.gate_up_proj``) and by the name the checkpoint stores
    it under where that differs (``block_sparse_moe.experts.3.w1.weight``, as adapters trained on
    per-expert modules name their targets).

    ``normalized``: the names are kept with their layer and expert indices as ``*`` (the catalogue's
    table), and a name whose layer is past ``layers``, or whose expert is past the routed experts
    the table's fused expert tensors stack, is refused with the count.
    """

    def __init__(
        self,
        shapes: dict[str, Shape],
        transposed: Iterable[str] = (),
        normalized: bool = False,
        layers: int | None = None,
    ) -> None:
        self.shapes = shapes
        self.transposed_names = set(transposed)
        self.normalized = normalized
        self.layers = layers
        stacked = [s[0] for n, s in shapes.items() if len(s) == 3 and ".experts." in n]
        self.experts = max(stacked) if normalized and stacked else None
        self._modules: dict[str, list[str]] = {}
        for name in shapes:
            self._modules.setdefault(name.rpartition(".")[0], []).append(name)

    def _key(self, name: str) -> str:
        if not self.normalized:
            return name
        index = layer_index(name)
        if self.layers is not None and index is not None and index >= self.layers:
            raise UserError(f"the adapter targets {clip(name.removesuffix('.weight'), 80)}, but the base has {self.layers} layers")
        expert = expert_index(name)
        if self.experts is not None and expert is not None and expert >= self.experts:
            raise UserError(
                f"the adapter targets {clip(name.removesuffix('.weight'), 80)}, but the base has {self.experts} routed experts a layer"
            )
        return normalize(name)

    def shape(self, name: str) -> Shape | None:
        found = self.shapes.get(self._key(name))
        return tuple(found) if found is not None else None

    def params(self, module: str) -> list[str]:
        """The names of ``module``'s own tensors (``module.X``), as the adapter would name them."""
        key = self._key(module + ".x").removesuffix(".x")
        return [module + "." + name.rpartition(".")[2] for name in self._modules.get(key, [])]

    def transposed(self, name: str) -> bool:
        """Whether the 3-D expert tensor ``name`` is stored [experts, in, out] (else [experts, out, in])."""
        return self._key(name) in self.transposed_names


@dataclass(frozen=True)
class LoraPair:
    """One module's LoRA matrices, checked: both present, of one rank.

    A pair on a Linear module (``target_modules``) changes ``{module}.weight``; one on a parameter
    (PEFT's ``target_parameters``, ``module`` then names the parameter) changes that tensor, and on
    a 3-D tensor of routed experts ([experts, out, in]) holds every expert's matrices: A is
    [experts * r, in] (expert-major), B is [out, r * experts] (expert-minor), as PEFT's ParamWrapper
    stores them.
    """

    module: str  # the module's name in the base model: model.layers.0.self_attn.q_proj
    a: str  # the stored names of A ([r, in]) and B ([out, r]); transposed under fan_in_fan_out
    b: str
    embedding: bool
    transposed: bool
    rank: int
    change: tuple[int, ...]  # the shape of the change it makes: the target weight's
    scaling: float | None  # alpha / r (alpha / sqrt(r) under rsLoRA); None until the config is read
    parameter: bool = False  # a target_parameters pair: ``module`` names the tensor itself
    experts: int = 1  # the number of experts a 3-D target stacks
    experts_transposed: bool = False  # the 3-D target is [experts, in, out]

    @property
    def target(self) -> str:
        return self.module if self.parameter else f"{self.module}.weight"


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


def _parameter_pair(pair: LoraPair, target: str, shape: Shape, transposed: bool) -> LoraPair | None:
    """``pair`` as PEFT's ParamWrapper on the tensor ``target`` of ``shape``, if its matrices fit it."""
    if pair.embedding or pair.transposed:
        return None
    if len(shape) == 2:
        fits = pair.change == tuple(shape)
        return dataclasses.replace(pair, module=target, parameter=True) if fits else None
    if len(shape) != 3:
        return None
    experts, d1, d2 = shape
    inputs, outputs = (d1, d2) if transposed else (d2, d1)
    if pair.change != (outputs, inputs) or pair.rank % experts:
        return None
    return dataclasses.replace(
        pair, module=target, parameter=True, rank=pair.rank // experts, change=tuple(shape), experts=experts,
        experts_transposed=transposed,
    )


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


def _mismatch(pair: LoraPair, expected: Shape) -> UserError:
    change = "x".join(str(d) for d in pair.change)
    return UserError(
        f"the adapter's {clip(pair.module, 80)}: it makes a {change} change, but the base's "
        f"{clip(pair.target, 80)} is {'x'.join(str(d) for d in expected)}: the adapter was trained on another base model"
    )


def _fitting_pair(
    module: str, parts: dict[str, str], shapes: dict[str, Shape], orientations: list[bool], base: BaseTensors | None
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
        expected = base.shape(pair.target) if base is not None else pair.change
        if expected is None:
            return None
        if tuple(expected) == pair.change:
            return pair
        problem = problem or _mismatch(pair, expected)
    assert problem is not None
    raise problem


def _parameter_pairs(
    wrappers: list[tuple[str, dict[str, str]]], shapes: dict[str, Shape], config: dict[str, Any] | None, base: BaseTensors | None
) -> list[LoraPair] | None:
    """The pairs of PEFT's ParamWrappers on one module (``m``, ``m.base_layer``, ...: one per tensor
    of ``m`` the adapter targets), each matched to the one tensor of ``m`` its matrices fit.

    None when the base has no tensor for them (the caller reports the module as missing).
    """
    if base is None:
        return None
    module = wrappers[0][0].replace(BASE_LAYER, "")
    wanted = [str(t) for t in (config or {}).get("target_parameters") or []]
    tensors = [
        name for name in base.params(module)
        if (shape := base.shape(name)) is not None and len(shape) in (2, 3)
        and (not wanted or any(name == t or name.endswith("." + t) for t in wanted))
    ]
    pairs: list[LoraPair] = []
    for key, parts in wrappers:
        pair = _pair(key, parts, shapes, False)
        fitting = []
        for name in tensors:
            shape = base.shape(name)
            assert shape is not None
            fitted = _parameter_pair(pair, name, shape, base.transposed(name))
            if fitted is not None:
                fitting.append(fitted)
        taken = {p.target for p in pairs}
        fitting = [p for p in fitting if p.target not in taken]
        if not fitting:
            if not tensors:
                return None
            raise UserError(
                f"the adapter's {clip(key, 80)}: its LoRA matrices {shapes[pair.a]} and {shapes[pair.b]} fit none of "
                f"the base's {', '.join(clip(t, 80) for t in tensors)}: the adapter was trained on another base model"
            )
        if len(fitting) > 1:
            raise UserError(
                f"the adapter's {clip(key, 80)}: its LoRA matrices fit more than one of the base's tensors "
                f"({', '.join(p.target for p in fitting)}), so which one it changes is ambiguous"
            )
        pairs.append(fitting[0])
    return pairs


def lora_modules(
    shapes: dict[str, Shape], config: dict[str, Any] | None, base: BaseTensors | None = None, max_pattern_steps: int | None = None
) -> tuple[list[LoraPair], dict[str, str]]:
    """The adapter's LoRA pairs and the tensors it saves whole (``modules_to_save``: base name ->
    stored name), checked as the merge will apply them.

    Every pair is complete, 2-D and of one rank; with the config, that rank is the one it gives the
    module, and each pair gets its scaling. With ``base``, each change and each whole tensor has
    the shape of the base tensor it replaces or adds to: a pair on a Linear module changes its
    ``weight``; pairs on the module's other tensors (``target_parameters``: routed experts' 3-D
    ``gate_up_proj`` and ``down_proj``, a router's weight) change the tensor their matrices fit.
    Without the config (not read yet), either orientation of ``fan_in_fan_out`` is accepted.
    ``max_pattern_steps`` bounds what matching the config's patterns may cost (``Patterns``).
    """
    pairs, whole = lora_pairs(shapes)
    if not pairs and not whole:
        raise UserError(f"{WEIGHTS_NAME} holds no LoRA weights")
    orientations = [bool(config.get("fan_in_fan_out"))] if config is not None else [False, True]
    ranks, alphas = (Patterns.of(config, "rank_pattern"), Patterns.of(config, "alpha_pattern")) if config else (None, None)
    for patterns in (ranks, alphas):
        if patterns is not None and max_pattern_steps is not None:
            patterns.check_cost(list(pairs), max_pattern_steps)
    checked: list[LoraPair] = []
    missing: list[str] = []
    wrapped: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for module, parts in sorted(pairs.items()):
        wrapped.setdefault(module.replace(BASE_LAYER, ""), []).append((module, parts))
    for clean, wrappers in sorted(wrapped.items()):
        found: list[LoraPair] | None = []
        if len(wrappers) == 1 and BASE_LAYER not in wrappers[0][0]:
            pair = _fitting_pair(clean, wrappers[0][1], shapes, orientations, base)
            found = [pair] if pair is not None else None
        if not found:
            found = _parameter_pairs(wrappers, shapes, config, base)
        if found is None:
            missing.extend(m for m, _ in wrappers)
            continue
        checked.extend(_scaled(p, config, ranks, alphas) if config is not None and ranks and alphas else p for p in found)
    if missing:
        raise UserError(
            f"the adapter targets modules the base model does not have: {', '.join(clip(m, 80) for m in missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    for name, stored in whole.items():
        expected = base.shape(name) if base is not None else shapes[stored]
        if expected is None:
            raise UserError(f"the adapter saves {clip(name, 80)}, which the base model does not have")
        if tuple(expected) != shapes[stored]:
            raise UserError(
                f"the adapter's {clip(name, 80)} has shape {shapes[stored]}, the base's {tuple(expected)}: "
                "the adapter was trained on another base model"
            )
    return checked, whole


def table_base(table: dict[str, Any]) -> BaseTensors | None:
    """The base tensors of the table ``base_weight_shapes`` makes (shapes by normalized name and
    the number of layers); None when the table holds no shapes."""
    tensors = table.get("tensors") or {}
    if not tensors:
        return None
    shapes = {name: tuple(shape) for name, shape in tensors.items()}
    return BaseTensors(shapes, table.get("transposed") or (), normalized=True, layers=table.get("layers"))


