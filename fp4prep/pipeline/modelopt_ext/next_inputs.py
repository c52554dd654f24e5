"""The next decoder layer's inputs from the outputs its calibration computed anyway.

Before calibrating a layer, ModelOpt's layerwise calibration runs it once more over every
calibration batch, its quantizers off, to capture what the next layer receives. Max calibration,
which every calibration here starts with, runs the layer over the same batches with quantization
off as well (its quantizers only collect ranges), so its outputs are those inputs. ``NextInputs``
keeps them as that first pass computes them, and once the layer is calibrated runs ModelOpt's
capture with the layer answering from them: the model's own forward still runs, the earlier
layers as ModelOpt's placeholders, so what the parent hands the next layer beside its hidden
states (masks, positions) is captured exactly as before, and the layer is not run again.

A first pass that quantized anything (none here does) is refused rather than handed on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PipelineError

Replay = Callable[[torch.nn.Module], None]
Capture = Callable[[Any, torch.nn.Module, Replay], list]


class NextInputs:
    """Stands in for ``LayerActivationCollector.cache_outputs_for_next_layer_calib`` (``capture``)
    through one layerwise calibration: ``defer`` is what ModelOpt calls, ``recording`` wraps the
    replay it hands the layer's calibration, ``fill`` completes the inputs it was given."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self._pending: dict[int, _Pending] = {}

    def defer(self, collector: Any, layer: torch.nn.Module, forward_loop: Replay) -> list:
        """An empty list, ModelOpt's next inputs once ``fill`` has run for ``layer``."""
        pending = _Pending(collector, forward_loop)
        self._pending[id(layer)] = pending
        return pending.inputs

    def recording(self, layer: torch.nn.Module, replay: Replay) -> Replay:
        """``replay``, keeping the layer's outputs the first time it runs, where a capture waits."""
        pending = self._pending.get(id(layer))
        if pending is None:
            return replay

        def first_kept(m: torch.nn.Module) -> None:
            if pending.first_done:
                return replay(m)
            pending.first_done = True
            if _quantizes(layer):
                raise PipelineError(
                    "the layer's first calibration pass quantizes: its outputs are not the next layer's inputs"
                )
            handle = layer.register_forward_hook(lambda _m, _args, output: pending.outputs.append(output))
            try:
                replay(m)
            finally:
                handle.remove()

        return first_kept

    def fill(self, layer: torch.nn.Module) -> None:
        """After the layer's calibration: its captured outputs handed on as the next inputs."""
        from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

        pending = self._pending.pop(id(layer), None)
        if pending is None:
            return
        batches = len(getattr(layer, LayerActivationCollector._LAYER_ATTR).collected_inputs)
        if len(pending.outputs) != batches:
            raise PipelineError(
                f"calibration ran {len(pending.outputs)} of the layer's {batches} calibration batches "
                "before changing it: the next layer's inputs are unknown"
            )
        previous = layer._original_forward
        layer._original_forward = lambda *_args, **_kwargs: pending.outputs.popleft()  # type: ignore[assignment]
        try:
            pending.inputs.extend(self.capture(pending.collector, layer, pending.forward_loop))
        finally:
            layer._original_forward = previous


class _Pending:
    """One layer's deferred capture: ModelOpt's arguments, the list it was given, the outputs kept."""

    def __init__(self, collector: Any, forward_loop: Replay) -> None:
        self.collector = collector
        self.forward_loop = forward_loop
        self.inputs: list = []
        self.outputs: deque = deque()
        self.first_done = False


def _quantizes(layer: torch.nn.Module) -> bool:
    """Whether running ``layer`` now would change any tensor on its way through a quantizer."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return any(
        isinstance(m, TensorQuantizer) and not m._disabled and (m._if_quant or m.pre_quant_scale is not None)
        for m in layer.modules()
    )
