"""Merging a PEFT LoRA adapter into BF16 weights: fp32 math, BF16 out, one tensor when it is read.

``W' = W + scaling * (B @ A)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA),
per-module ``rank_pattern`` / ``alpha_pattern`` honoured. What the adapter can't be applied to as it
stands is refused with a message naming the module (``inputs.lora_targets.lora_modules``, the
same check an upload passes).

Nothing here holds a whole model: ``plan`` works from tensor shapes, each update reads its two LoRA
matrices only when its weight is merged (adapters on every expert of a large MoE base run to
gigabytes), and ``MergedWeights`` merges a tensor when a layer asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..inputs.adapter_files import check_config
from ..inputs.lora_patterns import CONFIG_NAME
from ..inputs.lora_targets import BaseTensors, LoraPair, lora_modules, lora_pairs
from .experts import CheckpointNames
from .lazy import LazyWeights
from .safetensors import SafetensorsFile, TensorSource, read_config

MERGED_DTYPE = torch.bfloat16


@dataclass
class Adapter:
    directory: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]  # stored name -> shape
    read: Callable[[str], torch.Tensor]  # stored name -> tensor, read on demand


class FactorSlot:
    """The fp32 LoRA matrices of the last 3-D pair read, shared by its per-expert updates: the
    experts of one tensor are merged one after another, and each would otherwise read all of them."""

    def __init__(self) -> None:
        self.key: tuple[str, str] | None = None
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, key: tuple[str, str], load: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key != key or self.value is None:
            self.key, self.value = None, None  # the old pair goes before the new one is read
            self.value, self.key = load(), key
        return self.value


@dataclass
class LoraUpdate:
    """One stored tensor's low-rank change, read from the adapter when it is applied.

    Most change the whole tensor their pair targets. A pair on routed experts' 3-D tensor (PEFT's
    ``target_parameters``) changes expert ``expert`` only, and of that expert's change the ``rows``
    its stored tensor holds (a checkpoint stores each expert's gate and up projections apart, the
    model stacks them): the change is applied where the weight is stored, one expert at a time.
    """

    pair: LoraPair
    read: Callable[[str], torch.Tensor]
    stored: str | None = None  # the stored tensor it changes, where not the pair's target
    expert: int | None = None
    rows: tuple[int, int] | None = None
    slot: FactorSlot = field(default_factory=FactorSlot)

    @property
    def target(self) -> str:
        return self.stored or self.pair.target

    def _expert_factors(self, expert: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.pair

        def load() -> tuple[torch.Tensor, torch.Tensor]:
            a = self.read(pair.a).to(device, torch.float32)
            b = self.read(pair.b).to(device, torch.float32)
            # A is [experts * r, in], expert-major; B is [out, r * experts], expert-minor (PEFT's layout).
            return a.reshape(pair.experts, pair.rank, -1), b.reshape(b.shape[0], pair.rank, pair.experts)

        a, b = self.slot.get((pair.a, pair.b), load)
        left, right = b[:, :, expert], a[expert]  # the expert's change is left @ right: [out, in]
        return (right.T, left.T) if pair.experts_transposed else (left, right)

    def factors(self, device: torch.device | str = "cpu", expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` in fp32 such that the change is ``scaling * left @ right``."""
        expert = self.expert if expert is None else expert
        if self.pair.experts > 1:
            assert expert is not None
            left, right = self._expert_factors(expert, device)
            if self.rows is not None:
                left = left[self.rows[0] : self.rows[1]]
            return left, right
        a = self.read(self.pair.a).to(device, torch.float32)
        b = self.read(self.pair.b).to(device, torch.float32)
        if self.pair.transposed:  # fan_in_fan_out: the stored matrices are B^T and A^T
            a, b = b.T, a.T
        return (a.T, b.T) if self.pair.embedding else (b, a)

    @property
    def scaling(self) -> float:
        assert self.pair.scaling is not None  # planned with the adapter's config
        return self.pair.scaling

    def delta(self) -> torch.Tensor:
        if self.pair.experts > 1 and self.expert is None:
            return torch.stack([self._delta(e) for e in range(self.pair.experts)])
        return self._delta(None)

    def _delta(self, expert: int | None) -> torch.Tensor:
        left, right = self.factors(expert=expert)
        return (left @ right) * self.scaling

    def add_to(self, merged: torch.Tensor) -> None:
        """Add the change to ``merged`` (fp32, the stored tensor's shape) in place: one multiply-add
        (addmm) per matrix, computed where ``merged`` is (on the GPU when it is there)."""
        if self.pair.experts > 1 and self.expert is None:  # the whole 3-D tensor, stored as such
            for e in range(self.pair.experts):
                left, right = self.factors(merged.device, expert=e)
                merged[e].addmm_(left, right, alpha=self.scaling)
            return
        left, right = self.factors(merged.device)
        merged.addmm_(left, right, alpha=self.scaling)

    def apply(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with the change added in fp32 and rounded once to ``weight``'s dtype."""
        merged = weight.to(torch.float32, copy=True)
        self.add_to(merged)
        return merged.to(weight.dtype)


def load_adapter(directory: Path) -> Adapter:
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"adapter directory {directory} does not exist")
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise UserError(f"{directory} is not a PEFT adapter: {CONFIG_NAME} is missing")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{CONFIG_NAME}: not valid JSON ({exc})") from None
    weights = directory / "adapter_model.safetensors"
    read: Callable[[str], torch.Tensor]
    if weights.is_file():
        file = SafetensorsFile(weights)
        shapes = {name: file.shape(name) for name in file.entries}
        read = file.read
    elif (directory / "adapter_model.bin").is_file():
        tensors = torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        read = tensors.__getitem__
    else:
        raise UserError(f"{directory} has no adapter weights: adapter_model.safetensors is missing")
    check_config(config, lora_pairs(shapes)[0])
    return Adapter(directory, config, shapes, read)


def plan(adapter: Adapter, source: TensorSource) -> tuple[list[LoraUpdate], dict[str, str]]:
    """The updates the adapter makes to the checkpoint in ``source``; see ``plan_stored``."""
    names = CheckpointNames(read_config(source.directory), source.names())
    return plan_stored(adapter, names, {name: source.shape(name) for name in source.names()})


def plan_stored(
    adapter: Adapter, names: CheckpointNames, stored_shapes: dict[str, tuple[int, ...]]
) -> tuple[list[LoraUpdate], dict[str, str]]:
    """The updates the adapter makes, checked against the base's tensors, each on the stored tensor
    it changes.

    The adapter names its targets as the transformers model does (``mlp.experts.gate_up_proj``,
    ``mlp.gate.weight``) or, trained on per-expert modules, as the checkpoint stores them; a change
    to a fused expert tensor becomes one update per expert and stored part. Returns the updates and,
    for the tensors the adapter replaces whole (``modules_to_save``), the stored name -> the
    adapter's stored name.
    """
    base = BaseTensors({**stored_shapes, **names.shapes}, names.transposed)
    pairs, replacements = lora_modules(adapter.shapes, adapter.config, base)
    updates: list[LoraUpdate] = []
    slot = FactorSlot()
    for pair in pairs:
        fused = names.fused.get(pair.target)
        if fused is None:
            updates.append(LoraUpdate(pair, adapter.read, stored=names.plain.get(pair.target), slot=slot))
            continue
        experts = fused.per_expert()
        if experts is None or pair.experts != len(experts):
            raise UserError(
                f"the adapter changes {pair.target}, which transformers assembles from the checkpoint's "
                f"{len(fused.stored_names())} tensors in a way fp4prep can't split per expert "
                f"({', '.join(type(op).__name__ for op in fused.converter.operations)})"
            )
        for e, parts in enumerate(experts):
            row = 0
            for stored in parts:
                rows = stored_shapes[stored][0]
                updates.append(LoraUpdate(pair, adapter.read, stored=stored, expert=e, rows=(row, row + rows), slot=slot))
                row += rows
    if updates and not any(torch.any(adapter.read(pair.b)) for pair in pairs):
        raise UserError(
            "every LoRA-B matrix in the adapter is zero, so it changes nothing: "
            "it was saved before training updated it"
        )
    stored_replacements = {names.plain.get(name, name): stored for name, stored in replacements.items()}
    return updates, stored_replacements


class MergedWeights(LazyWeights):
    """The merged model as a lazy map of tensors: nothing is merged until a layer asks for it.

    ``MergedWeights[name]`` reads the base tensor (FP8 blocks dequantized), adds the adapter's change
    in fp32, rounds once to BF16 (the merged model *is* BF16, whatever we compute in), and hands it
    over in the compute dtype. No merged copy is ever written.
    """

    def __init__(
        self,
        source: TensorSource,
        adapter: Adapter | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(read_config(source.directory), source.names(), dtype, device)
        self.source = source
        shapes = {name: source.shape(name) for name in source.names()}
        updates, replacements = plan_stored(adapter, self.names, shapes) if adapter is not None else ([], {})
        self.updates: dict[str, list[LoraUpdate]] = {}
        for update in updates:
            self.updates.setdefault(update.target, []).append(update)
        self._replacements = replacements
        self._adapter = adapter
        # Called with (stored name, base, merged) for each tensor the adapter changes, as it is merged.
        self.watch: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None

    def targets(self) -> list[str]:
        """The stored tensors the adapter changes (checkpoint names, one per expert where the
        checkpoint stores experts apart)."""
        return sorted(set(self.updates) | set(self._replacements))

    def merged(self, name: str, base: torch.Tensor | None = None) -> torch.Tensor:
        """One stored tensor of the merged model, in BF16, on this map's device; ``base`` is the
        base's tensor where the caller has already read it (BF16 values in any wider dtype)."""
        if name in self._replacements:
            assert self._adapter is not None
            replaced = self._adapter.read(self._replacements[name]).to(self.device, MERGED_DTYPE)
            if self.watch is not None:
                self.watch(name, self.source.get(name, MERGED_DTYPE, self.device) if base is None else base, replaced)
            return replaced
        weight = self.source.get(name, MERGED_DTYPE, self.device) if base is None else base.to(self.device, MERGED_DTYPE)
        updates = self.updates.get(name)
        if not updates:
            return weight
        merged = weight.to(torch.float32)
        for update in updates:
            update.add_to(merged)
        merged = merged.to(MERGED_DTYPE)
        if self.watch is not None:
            self.watch(name, weight, merged)
        return merged

    def stored(self, name: str) -> torch.Tensor:
        return self.merged(name).to(self.dtype)

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)
