"""The merged model as a lazy map of tensors: nothing is merged until a layer asks for it.

``MergedWeights[name]`` reads the base tensor (FP8 blocks dequantized), adds the adapter's change in
fp32, rounds once to BF16 (the merged model *is* BF16, whatever we compute in), and hands it over in
the compute dtype. The model ``streaming.build`` makes over this map never holds the merged model
whole, and no merged copy is ever written.
"""

from __future__ import annotations

import torch

from .checkpoint import TensorSource
from .merge import Adapter, LoraUpdate, plan
from .streaming import LazyWeights

MERGED_DTYPE = torch.bfloat16


class MergedWeights(LazyWeights):
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
