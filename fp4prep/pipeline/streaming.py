"""A transformers model whose weights stay in a lazy map until the module that needs them runs.

``build`` makes the model from its config with every parameter on the meta device (no memory), then
attaches accelerate's offload hooks with our map as their ``weights_map``: right before a decoder
layer (or the final norm, or the output head) runs, its tensors are read from the map onto the
compute device, and right after, they go back to meta. The whole-model forward, ``generate``-style
decoding with a KV cache, ModelOpt's layerwise calibration (which keeps one layer materialized
while it replays that layer's inputs) and ModelOpt's streaming export all work unchanged on such a
model, with one layer's weights in memory at a time.

The input embeddings stay resident on the device (and the output head when it shares their
weights): a model's first parameter decides ``model.device``, which transformers and ModelOpt use to
place inputs, and the embeddings are needed by every forward anyway.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint import ExpertLayout, fold, hf_config
from .device import Compute
from .errors import UserError


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors by the names a transformers model uses, each computed when asked for.

    Subclasses read one stored tensor (``stored``) in ``dtype`` on ``device``, where whatever
    arithmetic it takes (merging, dequantizing) is done; fused expert tensors are assembled here
    from the stored per-expert ones.
    """

    def __init__(self, stored_names: list[str], dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.layout = ExpertLayout(stored_names)
        self.dtype = dtype
        self.device = torch.device(device)
        self._names = self.layout.names()
        self._stored = set(stored_names)
        # ModelOpt writes materialized weights back into ``weights_map.state_dict`` for the keys it
        # holds. Until ``keep_written`` gives it a store, it holds none: calibrations that only set
        # amax have nothing to keep.
        self.state_dict: Mapping[str, torch.Tensor] | WrittenBack = {}
        self._last_layer: str | None = None
        self._read = 0

    def keep_written(self, directory: Path) -> WrittenBack:
        """From now on keep what is written back (weights a calibration changed: AWQ's smoothing,
        folded scales) in ``directory``, and read those instead of computing them again."""
        store = WrittenBack(self, directory)
        self.state_dict = store
        return store

    def stored(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def stored_shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = self.layout.parts(name)
        if isinstance(self.state_dict, WrittenBack) and self.state_dict.holds(name):
            tensor = self.state_dict.load(name)
        elif parts is not None:
            tensor = fold(parts, self.stored, self.stored_shape)
        elif name not in self._stored:
            raise KeyError(name)
        else:
            tensor = self.stored(name)
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
        return isinstance(name, str) and (name in self._stored or self.layout.parts(name) is not None)

    def numel(self, name: str) -> int:
        parts = self.layout.parts(name)
        names = [n for expert in parts for n in expert] if parts is not None else [name]
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
    entry's device and dtype; every tensor of the map counts as present, and one not written yet
    reads as an empty tensor of the map's dtype on its device (all accelerate takes from it).
    The directory belongs to the run: a resumed run finds what it wrote.
    """

    def __init__(self, weights: LazyWeights, directory: Path) -> None:
        self.weights = weights
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._written = {p.stem for p in directory.glob("*.safetensors")}

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.safetensors"

    def holds(self, name: str) -> bool:
        return name in self._written

    def load(self, name: str) -> torch.Tensor:
        from safetensors.torch import load_file

        return load_file(str(self._path(name)), device=str(self.weights.device))["tensor"].to(self.weights.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.holds(name):
            return self.load(name)
        return torch.empty(0, dtype=self.weights.dtype, device=self.weights.device)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        import os

        from safetensors.torch import save_file

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


_LAYER = re.compile(r"^.*?\.layers\.\d+\.")
# The heap is trimmed when a new layer starts and this many bytes of weights were read since the
# last trim: on small layers trimming every time would cost more than it saves.
TRIM_AFTER_BYTES = 32 << 20
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 4 << 20


def keep_memory_returnable() -> None:
    """Make the C heap give each layer's memory back to the system, however deep the model.

    A layer's weights and activations are freed after it runs, but glibc keeps freed memory in its
    heap, where the fragments of one layer after another add up (measured after calibration, 48
    layers of a hidden-1024 model held 300 MiB more than 8 layers, all of it free heap). glibc
    also raises its mmap threshold up to 32 MiB as large blocks are freed, putting ever larger
    tensors on that heap. So: the threshold is pinned at 4 MiB (weight matrices and activations of
    that size are mapped and unmapped; pinning it lower made the demo 70% slower), and the heap is
    trimmed as layers are read (``trim_heap``). No effect where the C library is not glibc.
    """
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system, wherever they are in it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder's ``ModuleList`` of layers and its dotted name."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("layers") and len(module) > 0:
            return name, module
    raise UserError(f"{type(model).__name__} has no list of decoder layers that can be streamed")


def build(
    config: dict[str, Any],
    weights: LazyWeights,
    compute: Compute,
    source_dir: Path,
    before_hooks: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """The model of ``config`` reading its weights from ``weights``, one module at a time."""
    return attach(skeleton(config, weights, compute, source_dir), weights, compute, before_hooks)


def skeleton(config: dict[str, Any], weights: LazyWeights, compute: Compute, source_dir: Path) -> Any:
    """The model of ``config`` with every parameter on the meta device: its shapes, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    hf = hf_config(config, source_dir)
    # Experts one F.linear at a time: the reference semantics, and the only path ModelOpt's
    # quantized experts intercept. transformers may otherwise pick batched kernels whose rounding
    # differs, so the reference, the calibrated model and the reader would not agree.
    hf._experts_implementation = "eager"
    with init_empty_weights():  # parameters on meta; buffers (rotary tables) computed for real
        model = AutoModelForCausalLM.from_config(hf, dtype=compute.dtype)
    model.eval()
    model.requires_grad_(False)
    _check_names(model, weights)
    return model


def attach(
    model: Any,
    weights: LazyWeights,
    compute: Compute,
    before_hooks: Callable[[torch.nn.Module], None] | None = None,
) -> Any:
    """Load what stays resident and hook every other module to read its weights when it runs.

    ``before_hooks`` may replace modules' ``forward`` methods: accelerate's hooks wrap whatever
    ``forward`` is in place when they are attached.
    """
    from accelerate.hooks import attach_align_device_hook_on_blocks

    for name, buffer in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        # Persistent buffers the checkpoint holds (a router's bias) come from it; the rest (rotary
        # tables) were computed when the skeleton was built.
        value = weights.stored(name).to(buffer.dtype) if name in weights else buffer
        module._buffers[leaf] = value.to(compute.device)

    embeddings = model.get_input_embeddings()
    name = _name_of(model, embeddings)
    embeddings.weight = torch.nn.Parameter(weights[f"{name}.weight"].to(compute.device), requires_grad=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        model.tie_weights()

    if before_hooks is not None:
        before_hooks(model)
    layers_name, layers = decoder_layers(model)
    blocks = [f"{layers_name}.{i}" for i in range(len(layers))]
    inside = {id(m) for layer in layers for m in layer.modules()}
    resident = {id(m) for m in embeddings.modules()}
    if tied:
        resident |= {id(m) for m in model.get_output_embeddings().modules()}
    for module_name, module in model.named_modules():
        owns = any(p is not None for p in module._parameters.values())
        if owns and id(module) not in inside and id(module) not in resident:
            blocks.append(module_name)
    attach_align_device_hook_on_blocks(
        model,
        execution_device={"": compute.device, **dict.fromkeys(blocks, compute.device)},
        offload=dict.fromkeys(blocks, True),
        weights_map=weights,
        skip_keys=["cache", "past_key_values"],  # the KV cache stays where the model keeps it
    )
    return model


def layer_bytes(model: torch.nn.Module, weights: LazyWeights, dtype: torch.dtype) -> list[int]:
    """The size of each decoder layer's weights in ``dtype``, read from the map's shapes."""
    layers_name, layers = decoder_layers(model)
    size = torch.empty(0, dtype=dtype).element_size()
    sizes = []
    for i, layer in enumerate(layers):
        prefix = f"{layers_name}.{i}."
        sizes.append(sum(weights.numel(prefix + n) * size for n, _ in _named_tensors(layer)))
    return sizes


def resident_bytes(model: Any, dtype: torch.dtype) -> int:
    """What stays on the device between layers: the input embeddings (shared with the head if tied)."""
    weight = model.get_input_embeddings().weight
    return weight.numel() * torch.empty(0, dtype=dtype).element_size()


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters())


def _name_of(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise UserError(f"{type(model).__name__}: its input embeddings are not one of its modules")


def _check_names(model: Any, weights: LazyWeights) -> None:
    expected = set(model.state_dict())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    output = model.get_output_embeddings()
    output_name = _name_of(model, output) if output is not None else None
    optional = {f"{output_name}.weight"} if tied and output_name else set()
    non_persistent = {
        f"{name}.{leaf}" if name else leaf
        for name, module in model.named_modules()
        for leaf in getattr(module, "_non_persistent_buffers_set", ())
    }
    have = set(weights)
    missing = sorted(expected - have - optional - non_persistent)
    unexpected = sorted(have - expected)
    if missing or unexpected:
        raise UserError(
            "the checkpoint's tensors do not match its config.json: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
