"""The lazy map of tensors a streamed model reads its weights from, and where changed ones are kept.

``LazyWeights`` gives each tensor by the name a transformers model uses, computed when asked for
(merged, dequantized, stacked); ``WrittenBack`` keeps the weights a calibration changed, on disk.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from . import reads
from .experts import CheckpointNames
from .memory import trim_heap

_LAYER = re.compile(r"^.*?\.layers\.\d+\.")
# The heap is trimmed when a new layer starts and this many bytes of weights were read since the
# last trim: on small layers trimming every time would cost more than it saves.
TRIM_AFTER_BYTES = 32 << 20


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors by the names a transformers model uses, each computed when asked for.

    Subclasses read one stored tensor by its stored name (``stored``) in ``dtype`` on ``device``,
    where whatever arithmetic it takes (merging, dequantizing) is done; the stored names map onto the
    model's as ``from_pretrained`` maps them (``experts.CheckpointNames``: renamed, per-expert
    tensors fused), and ``model_tensor`` may change a model tensor once it is assembled.
    """

    def __init__(
        self, config: dict[str, Any], stored_names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.names = CheckpointNames(config, stored_names)
        self.dtype = dtype
        self.device = torch.device(device)
        self._names = self.names.names()
        self._stored_names = set(stored_names)
        # ModelOpt writes materialized weights back into ``weights_map.state_dict`` for the keys it
        # holds. Until ``keep_written`` gives it a store, it holds none: calibrations that only set
        # amax have nothing to keep.
        self.state_dict: Mapping[str, torch.Tensor] | WrittenBack = {}
        self._last_layer: str | None = None
        self._read = 0
        self._shapes_only: Mapping[str, torch.Size] | None = None

    def keep_written(self, directory: Path) -> WrittenBack:
        """From now on keep what is written back (weights a calibration changed: AWQ's smoothing,
        folded scales) in ``directory``, and read those instead of computing them again."""
        store = WrittenBack(self, directory)
        self.state_dict = store
        return store

    @contextlib.contextmanager
    def shapes_only(self, shapes: Mapping[str, torch.Size]) -> Iterator[None]:
        """Inside, each tensor reads as zeros of its shape in ``shapes`` and nothing is read or
        computed: for a forward whose values are thrown away (ModelOpt's walk to find which
        projections share an input), which would otherwise read the whole model."""
        self._shapes_only = shapes
        try:
            yield
        finally:
            self._shapes_only = None

    def stored(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def stored_shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def model_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The model tensor ``name`` as assembled from the stored ones; subclasses may change it."""
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._shapes_only is not None:
            return torch.zeros(self._shapes_only[name], dtype=self.dtype, device=self.device)
        fused = self.names.fused.get(name)
        if isinstance(self.state_dict, WrittenBack) and self.state_dict.holds(name):
            tensor = self.state_dict.load(name)
        elif fused is not None:
            tensor = self.model_tensor(name, fused.assemble(name, self.stored, self.stored_shape))
        elif name in self.names.plain:
            tensor = self.model_tensor(name, self.stored(self.names.plain[name]))
        else:
            raise KeyError(name)
        self._read += tensor.numel() * tensor.element_size()
        layer = _LAYER.match(name)
        key = layer[0] if layer else None
        if key != self._last_layer and self._read >= TRIM_AFTER_BYTES:
            trim_heap()  # a new layer starts: what the last ones left free goes back
            self._read = 0
        self._last_layer = key
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.names.plain or name in self.names.fused)

    def holds_stored(self, name: str) -> bool:
        """Whether the checkpoint stores a tensor under ``name``."""
        return name in self._stored_names

    def numel(self, name: str) -> int:
        fused = self.names.fused.get(name)
        names = fused.stored_names() if fused is not None else [self.names.plain[name]]
        total = 0
        for n in names:
            count = 1
            for d in self.stored_shape(n):
                count *= d
            total += count
        return total


class WrittenBack(MutableMapping[str, torch.Tensor]):
    """Where accelerate's offload hooks write a module's tensors back (``weights_map.state_dict``),
    kept on disk, one safetensors file per tensor, so that changed weights survive the layer being
    offloaded again without the model ever being held whole.

    accelerate writes a tensor back only under a key the store already has, converted to that
    entry's device and dtype; every tensor of the map counts as present, and reads here as an empty
    tensor of the map's dtype on its device (all accelerate takes from it; written tensors are read
    through the map, ``load``). The directory belongs to the run: a resumed run finds what it wrote.
    """

    def __init__(self, weights: LazyWeights, directory: Path) -> None:
        self.weights = weights
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._written = {p.stem for p in directory.glob("*.safetensors")}
        self._fresh: set[str] = set()  # written ahead (``ahead``), not yet by their window
        self._ahead = False

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.safetensors"

    def holds(self, name: str) -> bool:
        return name in self._written

    def load(self, name: str) -> torch.Tensor:
        from safetensors.torch import load_file

        path = self._path(name)
        reads.count(path, path.stat().st_size)
        return load_file(str(path), device=str(self.weights.device))["tensor"].to(self.weights.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __getitem__(self, name: str) -> torch.Tensor:
        # What writing back takes from an entry: its device and dtype. The model reads written
        # tensors through the map (``load``), never here.
        return torch.empty(0, dtype=self.weights.dtype, device=self.weights.device)

    @contextlib.contextmanager
    def ahead(self) -> Iterator[None]:
        """Inside, tensors are written ahead of their window's own writeback, which then skips them
        (they have not changed since): a layer's changed weights are on disk before ModelOpt commits
        the layer, and written once."""
        self._ahead = True
        try:
            yield
        finally:
            self._ahead = False

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        import os

        from safetensors.torch import save_file

        if name in self._fresh and not self._ahead:
            self._fresh.discard(name)
            return
        if self._ahead:
            self._fresh.add(name)
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        # Rounded to BF16 as it is kept: the merged model's weights are BF16, what is exported is
        # cast to BF16, and the calibrated model must compute with what the checkpoint holds.
        save_file({"tensor": tensor.detach().to("cpu", torch.bfloat16).contiguous()}, str(tmp))
        os.replace(tmp, path)
        self._written.add(name)

    def __delitem__(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)
        self._written.discard(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._written))

    def __len__(self) -> int:
        return len(self._written)

    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*.safetensors"))
