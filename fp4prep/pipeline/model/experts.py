"""Routed experts as checkpoints store them (one 2-D weight per expert and projection) and as
transformers' MoE modules hold them (one 3-D tensor per projection, the experts stacked)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class ExpertLayout:
    """How checkpoints' per-expert 2-D weights map onto transformers' stacked expert tensors.

    ``experts.{e}.{gate,up}_proj.weight`` become ``experts.gate_up_proj[e]`` (gate rows first) and
    ``experts.{e}.down_proj.weight`` becomes ``experts.down_proj[e]``.
    """

    def __init__(self, names: list[str]) -> None:
        self.stacked: dict[str, list[list[str]]] = {}  # stacked name -> per expert, the stored names
        by_prefix: dict[str, dict[int, dict[str, str]]] = {}
        self.plain: list[str] = []
        for name in names:
            match = _EXPERT.match(name)
            if match:
                by_prefix.setdefault(match["prefix"], {}).setdefault(int(match["e"]), {})[match["proj"]] = name
            else:
                self.plain.append(name)
        for prefix, experts in by_prefix.items():
            order = [experts[e] for e in sorted(experts)]
            self.stacked[f"{prefix}.gate_up_proj"] = [[p["gate_proj"], p["up_proj"]] for p in order]
            self.stacked[f"{prefix}.down_proj"] = [[p["down_proj"]] for p in order]

    def names(self) -> list[str]:
        """The names a transformers model built from the config uses."""
        return self.plain + list(self.stacked)

    def parts(self, name: str) -> list[list[str]] | None:
        return self.stacked.get(name)


def stack(
    parts: list[list[str]], read: Callable[[str], torch.Tensor], shape: Callable[[str], tuple[int, ...]]
) -> torch.Tensor:
    """One stacked expert tensor from the per-expert ones (each expert's parts stacked by rows).

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
