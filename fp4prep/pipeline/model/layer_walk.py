"""Several batches through a streamed model's decoder layers, each layer read once for all of them.

A streamed model reads a decoder layer's weights every time the layer runs, so running the decoder
once per batch reads the whole model once per batch. Here the decoder's own forward runs first with
every layer standing aside, which reads no layer's weights and gives each batch's input to the first
layer and the arguments the decoder passes every layer (masks, rotary tables); then each layer is
brought in once and runs every batch; then the decoder's forward again, each layer standing aside
and the last handing over its output, applies what follows the layers (the final norm). The
arithmetic is the decoder's own, batch by batch: the states are the ones a forward per batch gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .streaming import decoder_layers

# The arguments the decoder passes one layer besides its hidden states.
Call = tuple[tuple[Any, ...], dict[str, Any]]


class _Stop(Exception):
    """Raised by the last layer's stand-in: nothing after the decoder layers is needed yet."""


@contextlib.contextmanager
def _standing_aside(layers: list[torch.nn.Module], stand_in: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Inside, layer ``i`` runs ``stand_in(i, hidden, *args, **kwargs)`` instead of itself."""
    saved = [layer.__dict__.get("forward") for layer in layers]
    for i, layer in enumerate(layers):
        layer.forward = lambda hidden, *args, i=i, **kwargs: stand_in(i, hidden, *args, **kwargs)
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


@torch.no_grad()
def layer_inputs(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, list[Call]]:
    """The first decoder layer's input for the batch ``ids`` and every layer's other arguments, from
    the decoder's own forward with each layer standing aside: no layer's weights are read. With
    ``cache``, the layers are handed it (their keys and values go there as they run)."""
    layers = list(decoder_layers(model)[1])
    calls: list[Call] = []
    first: list[torch.Tensor] = []

    def stand_in(i: int, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if i == 0:
            first.append(hidden)
        calls.append((args, kwargs))
        if len(calls) == len(layers):
            raise _Stop
        return hidden

    cached = {"cache": cache, "use_cache": True} if cache is not None else {"use_cache": False}
    with _standing_aside(layers, stand_in), contextlib.suppress(_Stop):
        model.get_decoder()(input_ids=ids, attention_mask=mask, **cached)
    return first[0], calls


@torch.no_grad()
def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
    """``layer``'s output for ``hidden``, its weights already in place (accelerate's wrapper around
    the layer's forward would bring them in again, then drop them)."""
    args, kwargs = call
    forward = getattr(layer, "_old_forward", layer.forward)
    out = forward(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def held(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Inside, the weights of ``modules`` stay in place however many times they run: accelerate's
    offload hooks (one on each module that owns weights) read them once on the way in and drop them
    on the way out, instead of at every call."""
    from accelerate.utils import align_module_device, has_offloaded_params

    offloaded = [m for m in modules if has_offloaded_params(m)]
    with contextlib.ExitStack() as stack:
        for m in offloaded:
            stack.enter_context(align_module_device(m))
        for m in offloaded:
            m._hf_hook.offload = False  # type: ignore[union-attr]
        try:
            yield
        finally:
            for m in offloaded:
                m._hf_hook.offload = True  # type: ignore[union-attr]


class Walk:
    """Batches ``(ids, attention mask)`` through the decoder layers, driven one layer at a time from
    outside (``layer``, the layer's weights in place), then the final norm (``finish``). With
    ``cache`` (a ``prompt_cache.PromptCache``), each batch's kept rows record their keys and values
    as ``recording`` tells it, batch by batch, at every layer."""

    def __init__(
        self, model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], cache: Any = None,
        recording: Callable[[int], None] | None = None,
    ) -> None:
        self.model, self.batches, self.recording = model, batches, recording
        self.layers = list(decoder_layers(model)[1])
        inputs = [layer_inputs(model, ids, mask, cache) for ids, mask in batches]
        self.hidden = [first for first, _ in inputs]
        self.calls = [calls for _, calls in inputs]
        self.done = 0  # layers run so far

    @torch.no_grad()
    def layer(self, index: int, layer: torch.nn.Module, after: Callable[[int], None] | None = None) -> None:
        """Every batch through decoder layer ``index`` (the next one), its weights in place;
        ``after(b)`` once batch ``b`` went through (another model's batch beside it)."""
        assert index == self.done, f"layer {index} walked after layer {self.done - 1}"
        for b, calls in enumerate(self.calls):
            if self.recording is not None:
                self.recording(b)
            self.hidden[b] = run_layer(layer, self.hidden[b], calls[index])
            if after is not None:
                after(b)
        self.done += 1

    @torch.no_grad()
    def finish(self) -> list[torch.Tensor]:
        """Each batch's last hidden states (after the final norm, ``[rows, len, hidden]``)."""
        assert self.done == len(self.layers), f"{self.done} of {len(self.layers)} layers walked"
        model, layers = self.model, self.layers
        inside = {id(m) for layer in layers for m in layer.modules()}
        with held([m for m in model.get_decoder().modules() if id(m) not in inside]):  # the final norm
            return [
                _after_layers(model, layers, ids, mask, last)
                for (ids, mask), last in zip(self.batches, self.hidden, strict=True)
            ]


def final_states(
    model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], cache: Any = None,
    recording: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Each batch's last hidden states (after the final norm, ``[rows, len, hidden]``) for the
    batches ``(ids, attention mask)``, reading each decoder layer's weights once (``Walk``)."""
    if not batches:
        return []
    walk = Walk(model, batches, cache, recording)
    for i, layer in enumerate(walk.layers):
        with held(list(layer.modules())):
            walk.layer(i, layer)
    return walk.finish()


def _after_layers(
    model: Any, layers: list[torch.nn.Module], ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """The decoder's output for ``ids`` whose last layer gave ``last``: its forward again, every
    layer standing aside and the last handing ``last`` over."""

    def handing_over(i: int, passing: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return last if i == len(layers) - 1 else passing

    with _standing_aside(layers, handing_over):
        return model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
