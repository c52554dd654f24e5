"""Merging a PEFT LoRA adapter into BF16 weights: fp32 math, BF16 out.

``W' = W + scaling * (B @ A)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA),
per-module ``rank_pattern`` / ``alpha_pattern`` honoured. Anything the adapter can't be applied to
as it stands is refused with a message naming the module.

Nothing here holds a whole model: ``plan`` works from tensor shapes, and each update reads its two
LoRA matrices only when its weight is merged (adapters on every expert of a large MoE base run to
gigabytes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .adapter_files import CONFIG_NAME, check_config, lora_pairs, pattern_value
from .checkpoint import SafetensorsFile
from .errors import UserError


@dataclass
class Adapter:
    directory: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]  # stored name -> shape
    read: Callable[[str], torch.Tensor]  # stored name -> tensor, read on demand


@dataclass
class LoraUpdate:
    """One targeted weight and its low-rank change, read from the adapter when it is applied."""

    target: str  # the base tensor's name
    a_name: str  # [r, in]
    b_name: str  # [out, r]
    scaling: float
    embedding: bool
    transposed: bool  # fan_in_fan_out: the stored matrices are B^T and A^T
    read: Callable[[str], torch.Tensor]

    def factors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(left, right)`` in fp32 such that the change is ``scaling * left @ right``."""
        a = self.read(self.a_name).to(device, torch.float32)
        b = self.read(self.b_name).to(device, torch.float32)
        if self.transposed:
            a, b = b.T, a.T
        return (a.T, b.T) if self.embedding else (b, a)

    def delta(self) -> torch.Tensor:
        left, right = self.factors()
        return (left @ right) * self.scaling

    def apply(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` with the change added in fp32 and rounded once to ``weight``'s dtype.

        Computed where ``weight`` is (on the GPU when it is there), in one fused multiply-add.
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


def plan(
    adapter: Adapter, base_shapes: dict[str, tuple[int, ...]]
) -> tuple[list[LoraUpdate], dict[str, str]]:
    """The updates the adapter makes, checked against the base's tensor names and shapes.

    Returns the LoRA updates and, for the tensors the adapter replaces whole (``modules_to_save``),
    the base name -> the adapter's stored name.
    """
    config = adapter.config
    pairs, replacements = lora_pairs(adapter.shapes)
    for name, key in replacements.items():
        shape = adapter.shapes[key]
        if name not in base_shapes:
            raise UserError(f"the adapter saves {name}, which the base model does not have")
        if shape != base_shapes[name]:
            raise UserError(
                f"the adapter's {name} has shape {shape}, "
                f"the base's {base_shapes[name]}: the adapter was trained on another base"
            )
    if not pairs and not replacements:
        raise UserError("the adapter holds no LoRA weights")

    r_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", r_default))
    updates = []
    missing = []
    for module, parts in sorted(pairs.items()):
        embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if embedding else "lora_A")
        b = parts.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None:
            raise UserError(f"the adapter's {module} has only one of its two LoRA matrices")
        target = f"{module}.weight"
        if target not in base_shapes:
            missing.append(module)
            continue
        r = int(pattern_value(config, "rank_pattern", module, r_default))
        alpha = float(pattern_value(config, "alpha_pattern", module, alpha_default))
        a_shape, b_shape = adapter.shapes[a], adapter.shapes[b]
        transposed = bool(config.get("fan_in_fan_out"))
        if transposed:
            a_shape, b_shape = b_shape[::-1], a_shape[::-1]
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise UserError(f"the adapter's {module} LoRA matrices are not 2-D: {a_shape} and {b_shape}")
        if a_shape[0] != r or b_shape[1] != r:
            r = a_shape[0]  # the tensors are the truth; PEFT saves them at their own rank
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        update = LoraUpdate(target, a, b, scaling, embedding, transposed, adapter.read)
        expected = base_shapes[target]
        got = (a_shape[1], b_shape[0]) if embedding else (b_shape[0], a_shape[1])
        if got != expected:
            raise UserError(
                f"the adapter's {module} makes a {got[0]}x{got[1]} change, but the base's {target} "
                f"is {expected[0]}x{expected[1]}: the adapter was trained on another base model"
            )
        updates.append(update)
    if missing:
        raise UserError(
            f"the adapter targets modules the base model does not have: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    if updates and not any(torch.any(adapter.read(u.b_name)) for u in updates):
        raise UserError(
            "every LoRA-B matrix in the adapter is zero, so it changes nothing: "
            "it was saved before training updated it"
        )
    return updates, replacements


def merge(state_dict: dict[str, torch.Tensor], adapter: Adapter) -> list[str]:
    """Apply the adapter to a whole ``state_dict`` in place; returns the names of the changed tensors.

    For small models and comparisons; the pipeline merges one tensor at a time (``weights``).
    """
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    updates, replacements = plan(adapter, shapes)
    for update in updates:
        state_dict[update.target] = update.apply(state_dict[update.target])
    for name, stored in replacements.items():
        state_dict[name] = adapter.read(stored).to(state_dict[name].dtype)
    return sorted({u.target for u in updates} | set(replacements))
