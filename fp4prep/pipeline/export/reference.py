"""The calibrated model's logits on a few tokens, computed as export walks the decoder layers.

The reload check compares the checkpoint, read back by the independent reader, with what the
calibrated model computes on a held-back example. A forward of its own would read every weight
calibration changed once more (kept on disk until export: on a big base, terabytes in BF16).
ModelOpt's streaming export materializes each decoder layer once to pack it; while the layer is
there, before its handlers pack it, the example's hidden states go through it, so the reference
costs no read of a layer's weights at all (the final norm and an untied output head are read once
more, after the walk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..model.layer_walk import layer_inputs, run_layer
from ..model.streaming import decoder_layers


class ReloadReference:
    """The hidden states of ``ids`` carried through ``model``'s decoder layers as export
    materializes them (``during_export``), then through the final norm and the output head
    (``logits``)."""

    def __init__(self, model: Any, ids: list[int]) -> None:
        self.model = model
        self.layers = list(decoder_layers(model)[1])
        self.position = {id(layer): i for i, layer in enumerate(self.layers)}
        device = model.get_input_embeddings().weight.device
        ids_tensor = torch.tensor([ids], dtype=torch.long, device=device)
        self.hidden, self.calls = layer_inputs(model, ids_tensor, torch.ones_like(ids_tensor))
        self.done = 0

    def _through(self, layer: torch.nn.Module) -> None:
        # Under the window export opened: the layer's weights are in place.
        self.hidden = run_layer(layer, self.hidden, self.calls[self.done])
        self.done += 1

    @contextlib.contextmanager
    def during_export(self) -> Iterator[None]:
        """Inside, each decoder layer that ModelOpt's streaming export materializes also takes the
        example's hidden states a layer further, in order."""
        from modelopt.torch.quantization.utils import core_utils

        original = core_utils.enable_weight_access_and_writeback

        @contextlib.contextmanager
        def window(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
            with original(module, *args, **kwargs):
                if self.position.get(id(module)) == self.done:
                    self._through(module)
                yield

        core_utils.enable_weight_access_and_writeback = window
        try:
            yield
        finally:
            core_utils.enable_weight_access_and_writeback = original

    @torch.no_grad()
    def logits(self) -> torch.Tensor | None:
        """The example's logits ``[len, vocab]`` (float32, on the CPU), or None where export did not
        walk every layer (a model whose weights were all resident takes ModelOpt's other path)."""
        from ..validation.parity import output_head

        norm = getattr(self.model.get_decoder(), "norm", None)
        if self.done != len(self.layers) or norm is None:
            return None
        with output_head(self.model) as head:
            return head(norm(self.hidden)[0])
