"""Everything fp4prep registers with ModelOpt or patches in it, for one run, undone when it ends.

- The fake-quant backends: ``backend.CpuBackend``, which weight quantizers name where there is no
  CUDA, and ``backend.InputBackend``, which input quantizers name everywhere (the engine's arithmetic).
- ``fp4prep``, a calibration algorithm whose per-layer function is the run's own ``LayerPass`` (the
  recipe's steps); restoring a calibrated model's state needs it registered too.
- ModelOpt's weight windows on a decoder layer, which also bring in and take out its block scales
  once calibration kept them on disk (``keep_block_scales``, ``block_scales.BlockScales``).
- ModelOpt's layerwise calibration, which hands each decoder layer, its weights in place and not
  yet changed, to ``before_layer`` where it is set (validation's first round runs there); where
  calibration changes weights, writes them back to the run's store before it commits the layer,
  and keeps only the quantizers in its per-layer checkpoint (a resume reads the weights from the
  store: no second copy of them is written); the next layer's inputs are the outputs of the layer's
  max-calibration pass, not of one more run of it (``next_inputs.NextInputs``).
- ModelOpt's static NVFP4 fake-quant kernel (Triton, called directly by quantizers with static block
  scales, whatever their backend) replaced by ``numerics.static_nvfp4_fake_quant``, the arithmetic
  the checkpoint holds: from the start without Triton, and after calibration on CUDA, where the
  calibrated model is then measured in the checkpoint's numerics (``use_checkpoint_numerics``).

A ``Session`` is a context manager: what it changed is put back as it was on exit, so two runs in
one process calibrate alike.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from ..device import Compute
from ..formats.numerics import static_nvfp4_fake_quant
from . import backend
from .block_scales import BlockScales
from .next_inputs import NextInputs

METHOD = "fp4prep"
# A decoder layer and the function that replays its calibration inputs through it.
LayerFunction = Callable[[torch.nn.Module, Callable[[torch.nn.Module], None]], None]


class Session:
    def __init__(self, compute: Compute) -> None:
        self.compute = compute
        self.backends = {backend.NAME: backend.CpuBackend(), backend.INPUTS: backend.InputBackend()}
        self.layer_pass: LayerFunction | None = None  # set by the calibration that runs the recipe
        self.before_layer: Callable[[torch.nn.Module], None] | None = None
        self._undo: list[Callable[[], None]] = []
        self._kernel_swapped = False

    def __enter__(self) -> Session:
        self._register_backends()
        self._register_algorithm()
        self._wrap_layerwise()
        if not _triton_available():
            self._swap_static_kernel()
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def use_checkpoint_numerics(self, model: torch.nn.Module) -> None:
        """Switch every quantizer of ``model`` to the checkpoint's arithmetic (weights) and the
        engine's (inputs), as fp4prep's backends compute them.

        On the CPU they already run them; on CUDA, ModelOpt's kernels calibrated the weights and
        this makes the model bit-comparable with the checkpoint's independent reload. FP8 layers
        then compute their products as the engine does (``backend.fp8_gemm_forward``, routed experts'
        ``backend.fp8_experts_forward``).
        """
        from modelopt.torch.quantization.nn import TensorQuantizer

        self._swap_static_kernel()
        for name, module in model.named_modules():
            if isinstance(module, TensorQuantizer) and module.is_enabled and backend.handles(module.num_bits):
                module.backend = backend.INPUTS if name.endswith("input_quantizer") else backend.NAME
            elif forward := backend.fp8_forward_of(module):
                # The engine multiplies an FP8 layer's codes and applies the scales after.
                module.forward = partial(forward, module)
                self._undo.append(partial(vars(module).pop, "forward", None))

    def keep_block_scales(self, model: torch.nn.Module, directory: Path) -> BlockScales:
        """From now on a decoder layer's block scales are in memory only while the layer is."""
        scales = BlockScales(model, directory, self.compute.device)
        stack = contextlib.ExitStack()
        stack.enter_context(scales.windows())
        self._undo.append(stack.close)
        return scales

    def _register_backends(self) -> None:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        registry = tq._QUANT_FUNCTIONAL_BACKENDS
        previous = {name: registry[name] for name in self.backends if name in registry}

        def undo() -> None:
            for name in self.backends:
                registry.pop(name, None)
            registry.update(previous)

        registry.update(self.backends)
        self._undo.append(undo)

    def _register_algorithm(self) -> None:
        from modelopt.torch.quantization.mode import CalibrateModeRegistry

        descriptor = _descriptor(self)
        name = f"{METHOD}_calibrate"
        previous = CalibrateModeRegistry.get(name)
        if previous is not None:
            CalibrateModeRegistry.remove_mode(name)
        CalibrateModeRegistry.register_mode(descriptor)

        def undo() -> None:
            CalibrateModeRegistry.remove_mode(name)
            if previous is not None:
                CalibrateModeRegistry.register_mode(type(previous))

        self._undo.append(undo)

    def _wrap_layerwise(self) -> None:
        """ModelOpt's layerwise calibration calls ``before_layer`` with each decoder layer before
        the layer's calibration (whatever the algorithm), inside the window that holds its weights;
        writes changed weights back before the layer is committed; checkpoints quantizers only;
        captures the next layer's inputs from the layer's first calibration pass."""
        from modelopt.torch.quantization import mode, model_calib
        from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

        original = mode.layerwise_calibrate

        class QuantizersOnly(model_calib._CheckpointState):  # type: ignore[misc, name-defined]
            @classmethod
            def from_folder(cls, checkpoint_dir: Any, num_layers: int, save_every: int = 1, **_: Any) -> Any:
                return super().from_folder(checkpoint_dir, num_layers, save_every=save_every, calib_mutates_weights=False)

        collector = LayerActivationCollector
        capture = collector.cache_outputs_for_next_layer_calib  # ModelOpt's own, whatever a call patches

        def layerwise(model: torch.nn.Module, forward_loop: Any, calib_func: Callable[..., Any], **kwargs: Any) -> Any:
            mutates = kwargs.get("calib_mutates_weights", True)
            next_inputs = NextInputs(capture) if not kwargs.get("get_qdq_activations_from_prev_layer") else None

            def calibrate_layer(layer: torch.nn.Module, replay: Any, *args: Any, **kw: Any) -> Any:
                if self.before_layer is not None:
                    self.before_layer(layer)
                if next_inputs is not None:
                    replay = next_inputs.recording(layer, replay)
                done = calib_func(layer, replay, *args, **kw)
                if mutates:
                    _write_back_now(layer)
                if next_inputs is not None:
                    next_inputs.fill(layer)
                return done

            # Where sessions nest, the innermost call (the first session's) is the one ModelOpt's
            # capture reaches; the others' calibrate_layer find nothing deferred and pass through.
            previous = collector.cache_outputs_for_next_layer_calib
            if next_inputs is not None:
                defer = next_inputs.defer
                collector.cache_outputs_for_next_layer_calib = lambda getter, layer, loop: defer(getter, layer, loop)  # type: ignore[method-assign, assignment]
            try:
                return original(model, forward_loop=forward_loop, calib_func=calibrate_layer, **kwargs)
            finally:
                collector.cache_outputs_for_next_layer_calib = previous  # type: ignore[method-assign]

        self._patch(mode, "layerwise_calibrate", layerwise)
        self._patch(model_calib, "_CheckpointState", QuantizersOnly)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until the session ends."""
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def _swap_static_kernel(self) -> None:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        if self._kernel_swapped:
            return
        self._patch(tq, "static_blockwise_fp4_fake_quant", static_nvfp4_fake_quant)
        self._patch(self, "_kernel_swapped", True)

    def run_layer(self, layer: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], None], **_: Any) -> None:
        if self.layer_pass is None:
            from ..errors import PipelineError

            raise PipelineError(f"ModelOpt ran the {METHOD} algorithm outside a calibration that set its layer pass")
        self.layer_pass(layer, forward_loop)


def _descriptor(session: Session) -> type:
    """A ModelOpt calibration mode whose per-layer function is ``session``'s."""
    from modelopt.torch.opt.config import ModeloptField
    from modelopt.torch.quantization.config import QuantizeAlgorithmConfig
    from modelopt.torch.quantization.mode import BaseCalibrateModeDescriptor

    class Config(QuantizeAlgorithmConfig):
        """fp4prep's recipe steps on each decoder layer, after max calibration."""

        method: Literal["fp4prep"] = ModeloptField("fp4prep")

    class Descriptor(BaseCalibrateModeDescriptor):
        @property
        def config_class(self) -> type[QuantizeAlgorithmConfig]:
            return Config

        _calib_func = session.run_layer

    return Descriptor


def _write_back_now(layer: torch.nn.Module) -> None:
    """Write the layer's weights back to the store its offload hooks read from, as the window that
    holds them will when it closes; where the store writes ahead (``lazy.WrittenBack.ahead``), that
    later writeback skips them."""
    from modelopt.torch.quantization.plugins.accelerate import _writeback_params_to_weights_map

    for module in layer.modules():
        hook = _align_hook(getattr(module, "_hf_hook", None))
        if hook is None:
            continue
        store: Any = getattr(hook.weights_map, "dataset", None)
        store = getattr(store, "state_dict", None)
        ahead = store.ahead() if hasattr(store, "ahead") else contextlib.nullcontext()
        with ahead:
            _writeback_params_to_weights_map(module, hook)


def _align_hook(hook: Any) -> Any:
    """The accelerate hook that loads a module's weights from a map (its ``offload`` flag is off
    while a window holds them, so ModelOpt's own lookup does not find it then)."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    if isinstance(hook, AlignDevicesHook) and hook.weights_map is not None:
        return hook
    if isinstance(hook, SequentialHook):
        return next((h for h in map(_align_hook, hook.hooks) if h is not None), None)
    return None


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
