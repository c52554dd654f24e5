"""A checkpoint's stored tensor names mapped onto the transformers model built from its config.

Checkpoints name tensors as their authors saved them: Mixtral's routed experts as
``block_sparse_moe.experts.3.w1.weight``, Qwen's and DeepSeek's as ``mlp.experts.3.gate_proj.weight``,
one 2-D weight per expert and projection. The model transformers builds holds them fused, one 3-D
tensor per projection (``mlp.experts.gate_up_proj``: the experts stacked, gate rows before up rows).
``from_pretrained`` maps one onto the other with the architecture's conversion mapping
(``transformers.conversion_mapping``: renamings, and converters that merge per-expert tensors).
``CheckpointNames`` applies that same mapping, built for the same model, name by name, so any layout
transformers loads is read here, one tensor at a time and without holding the model.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UserError
from .configs import hf_config

Shape = tuple[int, ...]


@dataclass
class Fused:
    """A model tensor a converter assembles from stored ones (one per expert and source pattern)."""

    converter: Any  # transformers' WeightConverter for this target (a template, copied per use)
    parts: dict[str, list[str]]  # the converter's source pattern -> stored names, experts in order

    def stored_names(self) -> list[str]:
        return [name for names in self.parts.values() for name in names]

    def per_expert(self) -> list[list[str]] | None:
        """Each expert's stored names in the order they are stacked, where the converter only stacks
        experts (and concatenates each expert's parts by rows); None for any other conversion."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = self.converter.operations
        kinds = [(type(op), getattr(op, "dim", None)) for op in ops]
        if kinds not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            return None
        columns = [self.parts[p] for p in self.converter.source_patterns if p in self.parts]
        if len({len(c) for c in columns}) != 1:
            return None
        return [list(expert) for expert in zip(*columns, strict=True)]

    def assemble(self, name: str, read: Callable[[str], torch.Tensor], shape: Callable[[str], Shape]) -> torch.Tensor:
        """The model tensor ``name`` from the stored ones ``read`` gives."""
        experts = self.per_expert()
        if experts is not None:
            return stack(experts, read, shape)
        # Any other conversion: transformers' own operations, on every part at once.
        converter = copy.deepcopy(self.converter)
        for pattern, names in self.parts.items():
            converter.collected_tensors[pattern] = [functools.partial(read, n) for n in names]
        out = converter.convert(name)
        if name not in out:
            raise UserError(f"transformers' conversion for {name} produced {sorted(out)}, not {name}")
        return torch.as_tensor(out[name])


class CheckpointNames:
    """Stored names -> the model's names, as ``from_pretrained`` maps them for this config.

    ``plain`` maps a model tensor read from one stored tensor (renamed or not) to its stored name;
    ``fused`` a model tensor assembled from several. ``shapes`` are the model's, for the tensors
    the checkpoint provides.
    """

    def __init__(self, config: dict[str, Any], stored_names: list[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        meta = meta_model(json.dumps(config, sort_keys=True))
        model_state = meta.state_dict()
        transforms = get_model_conversion_mapping(meta)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = meta.base_model_prefix
        self.plain: dict[str, str] = {}
        self.fused: dict[str, Fused] = {}
        for stored in sorted(stored_names, key=dot_natural_key):
            name, pattern = rename_source_key(stored, renamings, converters, prefix, model_state)
            if name not in model_state and stored in model_state:
                name, pattern = stored, None
            if pattern is None:
                self.plain[name] = stored
            else:
                fused = self.fused.setdefault(name, Fused(by_pattern[pattern], {}))
                fused.parts.setdefault(pattern, []).append(stored)
        self.shapes: dict[str, Shape] = {
            n: tuple(model_state[n].shape) for n in (*self.plain, *self.fused) if n in model_state
        }
        self.transposed = {n for n, shape in self.shapes.items() if len(shape) == 3 and _is_transposed(meta, n)}

    def names(self) -> list[str]:
        return [*self.plain, *self.fused]

    def stored_of(self) -> dict[str, str]:
        """Stored name -> the model tensor it becomes (part of)."""
        out = {stored: name for name, stored in self.plain.items()}
        for name, fused in self.fused.items():
            out.update(dict.fromkeys(fused.stored_names(), name))
        return out

    def expert_part(self, stored: str) -> tuple[int, slice] | None:
        """For a stored tensor the converter stacks per expert: its expert and its rows of that
        expert's slice of the model tensor (``w3``: the up rows of ``gate_up_proj``); else None."""
        for name, fused in self.fused.items():
            experts = fused.per_expert()
            if experts is None or stored not in fused.stored_names():
                continue
            for expert, parts in enumerate(experts):
                if stored in parts:
                    rows = self.shapes[name][1] // len(parts)
                    index = parts.index(stored)
                    return expert, slice(index * rows, (index + 1) * rows)
        return None


def _is_transposed(model: torch.nn.Module, name: str) -> bool:
    module_name = name.rpartition(".")[0]
    try:
        return bool(getattr(model.get_submodule(module_name), "is_transposed", False))
    except AttributeError:
        return False


@functools.lru_cache(maxsize=4)
def meta_model(config_json: str) -> Any:
    """The transformers model of a config with every tensor on the meta device (shapes, no memory)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    hf = hf_config(json.loads(config_json), None)
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    return model


def stack(parts: list[list[str]], read: Callable[[str], torch.Tensor], shape: Callable[[str], Shape]) -> torch.Tensor:
    """One stacked expert tensor from the per-expert ones (each expert's parts stacked by rows),
    as transformers' MergeModulelist then Concatenate make it.

    Filled in place, so building it costs the stacked tensor plus one expert's part.
    """
    rows = sum(shape(name)[0] for name in parts[0])
    out: torch.Tensor | None = None
    for e, names in enumerate(parts):
        row = 0
        for name in names:
            tensor = read(name)
            if out is None:
                out = torch.empty((len(parts), rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            out[e, row : row + tensor.shape[0]] = tensor
            row += tensor.shape[0]
    assert out is not None
    return out
