"""Static block scales kept on disk while their decoder layer is not in memory.

GPTQ against static NVFP4 scales leaves each weight quantizer an FP32 maximum per 16 weights: an
eighth of its weights' BF16 bytes. Kept by every calibrated layer until export, they would grow with
the model (about 190 GB for a 750 B-parameter base, on the GPU where it computes) while everything
else streams. ``BlockScales`` writes a layer's scales to one file of the work directory when
ModelOpt closes the last window it opened on that layer (calibration finished it), leaves a
shapes-only placeholder on the meta device in their place, and reads them back whenever a window
on that layer opens again (export, a resumed run's restore) or the layer runs a forward
(``in_forward``). Per-channel maxima (FP8 weights) go the same way; a tensor's single one stays.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..model import reads
from ..model.streaming import decoder_layers


class BlockScales:
    def __init__(self, model: torch.nn.Module, directory: Path, device: torch.device) -> None:
        self.directory = directory
        self.device = device
        self.layers = list(decoder_layers(model)[1])
        self.index = {id(layer): i for i, layer in enumerate(self.layers)}
        self.open: dict[int, int] = {}  # layer index -> windows open on it
        # While calibrating, a layer's scales are written each time its last window closes (a
        # resumed run's restore puts back what it calibrated); afterwards they only change on
        # disk, so a layer leaving memory just drops them.
        self.recording = True
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.directory / f"{index:05d}.safetensors"

    def enter(self, layer: torch.nn.Module) -> None:
        index = self.index[id(layer)]
        self.open[index] = self.open.get(index, 0) + 1
        if self.open[index] == 1:
            self._load(index, layer)

    def leave(self, layer: torch.nn.Module) -> None:
        index = self.index[id(layer)]
        self.open[index] -= 1
        if self.open[index] == 0:
            self._offload(index, layer)

    def _load(self, index: int, layer: torch.nn.Module) -> None:
        from safetensors.torch import load_file

        away = {name: q for name, q in _block_quantizers(layer).items() if q._amax.is_meta}
        if not away:
            return
        path = self.path(index)
        reads.count(path, path.stat().st_size)
        saved = load_file(str(path), device=str(self.device))
        for name, quantizer in away.items():
            quantizer._buffers["_amax"] = saved[name]

    def _offload(self, index: int, layer: torch.nn.Module) -> None:
        from safetensors.torch import save_file

        held = {name: q for name, q in _block_quantizers(layer).items() if not q._amax.is_meta}
        if not held:
            return
        path = self.path(index)
        if self.recording or not path.is_file():
            tmp = path.with_suffix(".tmp")
            save_file({name: q._amax.detach().to("cpu").contiguous() for name, q in held.items()}, str(tmp))
            os.replace(tmp, path)
        for quantizer in held.values():
            quantizer._buffers["_amax"] = torch.empty_like(quantizer._amax, device="meta")

    def finish(self) -> None:
        """Calibration is done: from here on scales only come back from disk, and every layer not
        in a window leaves its own there (after a restore that put them all back, or on a model
        calibrated before they were kept apart)."""
        self.recording = False
        for index, layer in enumerate(self.layers):
            if not self.open.get(index):
                self._offload(index, layer)

    def close(self) -> None:
        """Forget the model: once it is exported, nothing here may keep its layers (and what export
        left on them) alive; windows opened afterwards pass through."""
        self.layers, self.index, self.open = [], {}, {}

    @contextlib.contextmanager
    def windows(self) -> Iterator[None]:
        """Inside, ModelOpt's weight windows on a decoder layer (calibration's, a restore's,
        export's) also bring its scales in and take them out again."""
        from modelopt.torch.quantization.utils import core_utils

        original = core_utils.enable_weight_access_and_writeback

        @contextlib.contextmanager
        def window(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
            with original(module, *args, **kwargs):
                if id(module) not in self.index:
                    yield
                    return
                self.enter(module)
                try:
                    yield
                finally:
                    self.leave(module)

        core_utils.enable_weight_access_and_writeback = window
        try:
            yield
        finally:
            core_utils.enable_weight_access_and_writeback = original

    @contextlib.contextmanager
    def in_forward(self) -> Iterator[None]:
        """Inside, a forward through a decoder layer brings its scales in for that layer's run."""
        handles = []
        for layer in self.layers:
            handles.append(layer.register_forward_pre_hook(lambda m, args: self.enter(m)))
            handles.append(layer.register_forward_hook(lambda m, args, out: self.leave(m)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _block_quantizers(layer: torch.nn.Module) -> dict[str, Any]:
    """The layer's quantizers holding a maximum per block of weights, by name within the layer."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    found = {}
    for name, module in layer.named_modules():
        if isinstance(module, TensorQuantizer) and "input_quantizer" not in name:
            amax = module._buffers.get("_amax")
            if amax is not None and amax.numel() > 1:
                found[name] = module
    return found
