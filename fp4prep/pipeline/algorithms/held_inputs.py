"""What the rounding of a release's changed weights walks: the BF16 merged model and the prepared one
side by side, one decoder layer at a time, and the Hessians of each changed weight's inputs.

A ``Target`` is one quantized weight of the release the adapter changes (a projection, or one routed
expert's). ``LayerHessians`` gathers, with forward pre-hooks on a decoder layer, the Hessians of the
targets' inputs: one per distinct input (q/k/v share theirs), a routed expert's from the rows of
the tokens its router sent it (the experts module's input for its gate and up projections,
``act(gate) * up`` computed from the layer's weights in place for its down projection). Paired,
each batch goes through the layer twice, the merged model's input first and then the prepared
model's, and each Hessian is the prepared model's (``X~ᵀX~``) with its product with the gap to the
merged model's inputs for the same tokens (``X~ᵀ(X - X~)``; a routed expert takes the tokens the
merged model's router sent it in both). ``stages`` orders a layer's targets by when the layer reads
their inputs, so that each stage's prepared inputs come from the stages before it already rounded
(``rounded_in`` puts their values in place for the prepared model's runs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..model.layer_walk import Call, Walk, run_layer
from ..model.merge import MergedWeights
from ..model.releases import QuantizedTensor
from .gptq import _Input

Key = tuple[str, int | None, bool]  # (module, expert, reads act(gate) * up)
# A rounded weight where the model holds it: the tensor, the index there (None: all of it), the value.
Placed = tuple[torch.Tensor, Any, torch.Tensor]


@dataclass(frozen=True)
class Target:
    """A quantized weight of the release the adapter changes, and where the model computes with it."""

    tensor: QuantizedTensor
    module: str  # the model's module that multiplies by it (a linear layer or a routed experts module)
    expert: int | None  # for a routed experts module: the expert
    inner: bool  # it reads the expert's ``act(gate) * up`` (a down projection), not the module's input

    @property
    def key(self) -> Key:
        return self.module, self.expert, self.inner

    @property
    def sliced(self) -> bool:
        """One expert of a tensor that stores every expert (gpt-oss's fused experts): rounded as
        that expert's rows."""
        return self.tensor.gpt_oss and self.expert is not None

    @property
    def columns(self) -> int:
        """The weight's inputs: gpt-oss's dense experts are ``[experts, inputs, outputs]``."""
        return self.tensor.shape[1] if self.tensor.gpt_oss else self.tensor.shape[-1]


@dataclass
class Paired(_Input):
    """The Hessian of one input in the prepared model (``X~^T X~``), and its product with how far the
    merged model's input is from it (``X~^T (X - X~)``)."""

    cross: torch.Tensor | None = None

    def add_pair(self, prepared: torch.Tensor, merged: torch.Tensor) -> None:
        """Add the rows of ``prepared`` (tokens by inputs) and the merged model's rows for the same tokens."""
        if not prepared.shape[0]:
            return
        self.add(prepared, 1)
        x = prepared.float()
        if self.cross is None:
            self.cross = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        self.cross.addmm_(x.T, merged.float() - x)


class LayerHessians:
    """Forward pre-hooks on one decoder layer gathering the Hessians of ``targets``' inputs.

    ``paired``: each batch runs the layer twice, the merged model's input first (its inputs to the
    targets kept) and then the prepared model's (``prepared`` set), and the Hessians are
    ``Paired``: the prepared model's, with the merged model's inputs for the same tokens. A routed
    expert takes the tokens the merged model's router sent it in both."""

    def __init__(
        self, model: torch.nn.Module, targets: list[Target], stride: int, paired: bool = False, probe: bool = False
    ) -> None:
        self.stride, self.paired, self.probe = stride, paired, probe
        self.prepared = False  # the run in progress is the prepared model's
        self.order: list[Key] = []  # probe: each input in the order the layer reads it, nothing gathered
        self.inputs: dict[Key, _Input] = {}
        self._kept: dict[Key, torch.Tensor] = {}  # the merged model's inputs of the batch in progress
        self._routing: dict[str, torch.Tensor] = {}  # the merged model's router choices, same batch
        self._last: tuple[torch.Tensor, Key] | None = None
        self._alias: dict[Key, Key] = {}
        modules = dict(model.named_modules())
        self._handles = []
        plain = sorted({t.module for t in targets if t.expert is None})
        for name in plain:
            self._handles.append(modules[name].register_forward_pre_hook(lambda _m, args, n=name: self._linear(n, args[0])))
        experts: dict[str, list[tuple[int, bool]]] = {}
        for t in targets:
            if t.expert is not None:
                experts.setdefault(t.module, []).append((t.expert, t.inner))
        for name, wanted in experts.items():
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, n=name, w=wanted: self._experts(n, m, w, args, kwargs), with_kwargs=True
            ))

    def hessian(self, target: Target) -> _Input | None:
        return self.inputs.get(self._alias.get(target.key, target.key))

    def _take(self, key: Key, rows: torch.Tensor) -> None:
        if self.probe:
            if key not in self.order:
                self.order.append(key)
        elif not self.paired:
            self.inputs.setdefault(key, _Input([key[0]])).add(rows, 1)
        elif not self.prepared:
            self._kept[key] = rows
        else:
            entry = self.inputs.setdefault(key, Paired([key[0]]))
            assert isinstance(entry, Paired)
            entry.add_pair(rows, self._kept.pop(key))

    def _linear(self, name: str, x: torch.Tensor) -> None:
        key = (name, None, False)
        if self._last is not None and self._last[0] is x:  # q/k/v, gate/up: one input, one Hessian
            self._alias[key] = self._last[1]
            return
        self._take(key, x.detach().reshape(-1, x.shape[-1])[:: self.stride])
        self._last = (x, key)

    def _experts(self, name: str, module: Any, wanted: list[tuple[int, bool]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("hidden_states", "top_k_index", "router_indices")  # gpt-oss: router_indices
        values = [*args, *(kwargs[k] for k in names if k in kwargs)]
        hidden, index = values[0], values[1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.paired:  # both runs take the tokens the merged model routed
            index = self._routing.pop(name) if self.prepared else self._routing.setdefault(name, index)
        for expert in sorted({e for e, _ in wanted}):
            rows = (index.reshape(hidden.shape[0], -1) == expert).any(-1).nonzero().squeeze(-1)
            if not rows.numel():
                continue
            x = hidden[rows]
            if (expert, False) in wanted:
                self._take((name, expert, False), x)
            if (expert, True) in wanted:
                if hasattr(module, "gate_up_proj_bias"):  # gpt-oss: [inputs, outputs], biases, interleaved gate and up
                    inner = module._apply_gate(x @ module.gate_up_proj[expert] + module.gate_up_proj_bias[expert])
                else:
                    gate, up = torch.nn.functional.linear(x, module.gate_up_proj[expert]).chunk(2, dim=-1)
                    inner = module.act_fn(gate) * up
                self._take((name, expert, True), inner)

    def pair(
        self, layer: torch.nn.Module, hidden: list[torch.Tensor], calls: list[Call],
        rounded: Callable[[], contextlib.AbstractContextManager[None]], batch: int,
    ) -> None:
        """The prepared model's input ``hidden[batch]`` through ``layer`` with the weights already
        rounded in place (``rounded``), pairing its inputs to the targets with those the merged
        model's run of the batch just kept."""
        self.prepared = True
        try:
            with rounded():
                run_layer(layer, hidden[batch], calls[batch])
        finally:
            self.prepared = False
            self._last = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


def chunks(layer_targets: list[Target], budget: int, matrices: int = 1) -> list[list[Target]]:
    """The layer's targets in passes of its inputs: as many routed experts a pass as their Hessians
    (``matrices`` of them per input) fit in ``budget`` bytes (at least one), the dense weights with
    the first."""
    dense = [t for t in layer_targets if t.expert is None]
    by_expert: dict[tuple[str, int | None], list[Target]] = {}
    for t in layer_targets:
        if t.expert is not None:
            by_expert.setdefault((t.module, t.expert), []).append(t)
    chunks: list[list[Target]] = []
    current: list[Target] = []
    used = 0
    for group in by_expert.values():
        size = sum(t.columns**2 * 4 * matrices for t in group)
        if current and used + size > budget:
            chunks.append(current)
            current, used = [], 0
        current += group
        used += size
    if current:
        chunks.append(current)
    if not chunks:
        return [dense] if dense else []
    chunks[0] = dense + chunks[0]  # the dense Hessians come with the first pass
    return chunks


def stages(model: torch.nn.Module, layer: torch.nn.Module, chunk: list[Target], hidden: torch.Tensor, call: Call) -> list[list[Target]]:
    """``chunk``'s targets in the order ``layer`` reads their inputs (a run of one batch tells), one
    stage per input (q/k/v, then o, ...; a routed experts module's inputs, then their ``act(gate) *
    up``): a stage's inputs in the prepared model come from the stages before it, rounded."""
    probe = LayerHessians(model, chunk, 1, probe=True)
    try:
        run_layer(layer, hidden, call)
    finally:
        probe.remove()
    rank: dict[Key, int] = {}
    for key in probe.order:
        rank.setdefault(key if key[1] is None else (key[0], None, key[2]), len(rank))

    def stage(t: Target) -> int:
        key = probe._alias.get(t.key, t.key) if t.expert is None else (t.module, None, t.inner)
        return rank.get(key, len(rank) + t.inner)  # an input batch one never reached: last

    by_stage: dict[int, list[Target]] = {}
    for t in chunk:
        by_stage.setdefault(stage(t), []).append(t)
    return [by_stage[k] for k in sorted(by_stage)]


def gather(
    model: torch.nn.Module, walk: Walk, index: int, stage: list[Target], stride: int, last: bool,
    prepared: list[torch.Tensor] | None, rounded: list[Placed],
) -> LayerHessians:
    """The Hessians of ``stage``'s inputs: every batch through decoder layer ``index`` (the walk
    moves past it where ``last``), and with ``prepared`` the prepared model's batch beside each, the
    layer's weights ``rounded`` so far in place for it."""
    layer = walk.layers[index]
    calls = [batch[index] for batch in walk.calls]
    hessians = LayerHessians(model, stage, stride, paired=prepared is not None)
    beside = None
    if prepared is not None:
        beside = functools.partial(hessians.pair, layer, prepared, calls, functools.partial(rounded_in, list(rounded)))
    try:
        if last:
            walk.layer(index, layer, beside)
        else:  # one more pass of the layer's inputs, for a chunk of experts or a stage
            for b, hidden in enumerate(walk.hidden):
                run_layer(layer, hidden, calls[b])
                if beside is not None:
                    beside(b)
    finally:
        hessians.remove()
    return hessians


def placed(model: torch.nn.Module, merged: MergedWeights, model_of: dict[str, str], target: Target, value: torch.Tensor) -> Placed:
    """Where the model holds ``target``'s weight (``model_of``: ``merged.names.stored_of()``), and
    ``value`` (by the stored rows) as it goes there: the whole tensor, its expert's rows of a fused
    tensor, or gpt-oss's ``[experts, inputs, outputs]``."""
    attr = model_of[target.tensor.name].rpartition(".")[2]
    param = getattr(model.get_submodule(target.module), attr)
    part = merged.names.expert_part(target.tensor.name)
    if target.sliced:
        return param, target.expert, value.T.to(param.dtype)
    if part is not None:
        return param, part, value.to(param.dtype)
    return param, None, value.to(param.dtype)


@contextlib.contextmanager
def rounded_in(values: list[Placed]) -> Iterator[None]:
    """Inside, the model's tensors hold ``values`` in place of the merged weights; put back on the way out."""
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for param, index, value in values:
            saved.setdefault(id(param), (param, param.data.clone()))
            if index is None:
                param.data.copy_(value)
            else:
                param.data[index] = value
        yield
    finally:
        for param, data in saved.values():
            param.data.copy_(data)
