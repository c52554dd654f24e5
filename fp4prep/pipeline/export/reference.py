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

from ..model.streaming import decoder_layers


class _Stop(Exception):
    """Raised by the last layer's stand-in: nothing after the decoder layers is needed yet."""


class ReloadReference:
    """The hidden states of ``ids`` carried through ``model``'s decoder layers as export
    materializes them (``during_export``), then through the final norm and the output head
    (``logits``)."""

    def __init__(self, model: Any, ids: list[int]) -> None:
        self.model = model
        self.layers = list(decoder_layers(model)[1])
        self.position = {id(layer): i for i, layer in enumerate(self.layers)}
        self.hidden, self.calls = self._layer_inputs(ids)
        self.done = 0

    @torch.no_grad()
    def _layer_inputs(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The first layer's input and every layer's other arguments (mask, rotary tables), from
        the decoder's own forward with each layer standing aside: no layer's weights are read."""
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        first: list[torch.Tensor] = []

        def stand_in(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not calls:
                first.append(hidden)
            calls.append((args, kwargs))
            if len(calls) == len(self.layers):
                raise _Stop
            return hidden

        saved = [layer.__dict__.get("forward") for layer in self.layers]
        for layer in self.layers:
            layer.forward = stand_in
        device = self.model.get_input_embeddings().weight.device
        try:
            ids_tensor = torch.tensor([ids], dtype=torch.long, device=device)
            self.model.get_decoder()(input_ids=ids_tensor, attention_mask=torch.ones_like(ids_tensor), use_cache=False)
        except _Stop:
            pass
        finally:
            for layer, forward in zip(self.layers, saved, strict=True):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward
        return first[0], calls

    def _through(self, layer: torch.nn.Module) -> None:
        args, kwargs = self.calls[self.done]
        # The layer's own forward, under the window export opened (accelerate's wrapper around it
        # would materialize the weights again, then drop them).
        forward = getattr(layer, "_old_forward", layer.forward)
        with torch.no_grad():
            out = forward(self.hidden, *args, **kwargs)
        self.hidden = out[0] if isinstance(out, tuple) else out
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
