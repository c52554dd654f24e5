"""Merging a PEFT LoRA adapter into BF16 weights: fp32 math, BF16 out, one tensor when it is read.

``W' = W + scaling * (B @ A)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA),
per-module ``rank_pattern`` / ``alpha_pattern`` honoured. What the adapter can't be applied to as it
stands is refused with a message naming the module (``inputs.adapter_files.lora_modules``, the
same check an upload passes).

Nothing here holds a whole model: ``plan`` works from tensor shapes, each update reads its two LoRA
matrices only when its weight is merged (adapters on every expert of a large MoE base run to
gigabytes), and ``MergedWeights`` merges a tensor when a layer asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..inputs.adapter_files import CONFIG_NAME, LoraPair, check_config, lora_modules, lora_pairs
from .lazy import LazyWeights
from .safetensors import SafetensorsFile, TensorSource

MERGED_DTYPE = torch.bfloat16


@dataclass
class Adapter:
    directory: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]  # stored name -> shape
    read: Callable[[str], torch.Tensor]  # stored name -> tensor, read on demand


@dataclass
class LoraUpdate:
    """One targeted weight and its low-rank change, read from the adapter when it is applied."""

    pair: LoraPair
    read: Callable[[str], torch.Tensor]

    @property
    def target(self) -> str:
        return self.pair.target

    def factors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` in fp32 such that the change is ``scaling * left @ right``."""
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
        left, right = self.factors()
        return (left @ right) * self.scaling

    def apply(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with the change added in fp32 and rounded once to ``weight``'s dtype.

        Computed where ``weight`` is (on the GPU when it is there), in one multiply-add (addmm).
        """
        left, right = self.factors(weight.device)
        merged = weight.to(torch.float32, copy=True)
        merged.addmm_(left, right, alpha=self.scaling)
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


def plan(adapter: Adapter, base_shapes: dict[str, tuple[int, ...]]) -> tuple[list[LoraUpdate], dict[str, str]]:
    """The updates the adapter makes, checked against the base's tensor names and shapes.

    Returns the LoRA updates and, for the tensors the adapter replaces whole (``modules_to_save``),
    the base name -> the adapter's stored name.
    """
    pairs, replacements = lora_modules(adapter.shapes, adapter.config, base_shapes.get)
    updates = [LoraUpdate(pair, adapter.read) for pair in pairs]
    if updates and not any(torch.any(adapter.read(u.pair.b)) for u in updates):
        raise UserError(
            "every LoRA-B matrix in the adapter is zero, so it changes nothing: "
            "it was saved before training updated it"
        )
    return updates, replacements


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
        super().__init__(source.names(), dtype, device)
        self.source = source
        shapes = {name: source.shape(name) for name in source.names()}
        updates, replacements = plan(adapter, shapes) if adapter is not None else ([], {})
        self.updates: dict[str, LoraUpdate] = {u.target: u for u in updates}
        self._replacements = replacements
        self._adapter = adapter

    def targets(self) -> list[str]:
        """The stored tensors the adapter changes (checkpoint names, one per expert)."""
        return sorted(set(self.updates) | set(self._replacements))

    def merged(self, name: str) -> torch.Tensor:
        """One stored tensor of the merged model, in BF16, on this map's device."""
        if name in self._replacements:
            assert self._adapter is not None
            return self._adapter.read(self._replacements[name]).to(self.device, MERGED_DTYPE)
        weight = self.source.get(name, MERGED_DTYPE, self.device)
        update = self.updates.get(name)
        return update.apply(weight) if update is not None else weight

    def stored(self, name: str) -> torch.Tensor:
        return self.merged(name).to(self.dtype)

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)
