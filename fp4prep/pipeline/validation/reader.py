"""An independent reader of the checkpoints we write: our own decoding, not ModelOpt's.

It dequantizes the safetensors into a dense transformers model, one tensor at a time as each layer
runs, and, where the format quantizes activations, quantizes each layer's input as the serving
engine does (``formats.engine``, from the stored input scales). The model it returns computes what the
checkpoint describes, so its logits are compared with the calibrated fake-quant model's and, in
parity, with the BF16 model's.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch

from ..device import Compute
from ..formats import ROUTED_EXPERTS, declared
from ..formats.engine import (
    engine_layers,
    fp8_experts,
    fp8_linear,
    fp8_per_token_activations,
    fp8_static_activations,
    mxfp4_activations,
    nvfp4_activations,
    nvfp4_global_scale,
)
from ..formats.numerics import (
    E4M3_MAX,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from ..model import streaming
from ..model.lazy import LazyWeights
from ..model.releases import BaseSource, release_of
from ..model.safetensors import TensorSource, read_config
from ..serving import NVFP4_W4A16, by_key

# An activation quantizer is a function applied to a Linear's input.
ActivationQuant = Callable[[torch.Tensor], torch.Tensor]


def _scalar(t: torch.Tensor) -> float:
    return float(t.float().reshape(-1)[0])


class DequantizedWeights(LazyWeights):
    """A quantized checkpoint's weights, dense, each dequantized when it is read.

    ``activations`` holds, per quantized module, the activation quantization a serving engine
    applies to its input (from the stored input scales); ``numerics`` names the engine's numerics
    where they are not the declared ones (``serving.EngineNumerics.key``).
    """

    def __init__(
        self, directory: Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", numerics: str | None = None
    ) -> None:
        self.numerics = numerics
        # Modules read as their E4M3 codes, not dequantized: the engine's FP8 product applies their
        # scales after the sums (``fp8_gemms`` and ``fp8_expert_parts`` add them).
        self.as_codes: set[str] = set()
        self.config = read_config(directory)
        # Per engine layer (``layers``): Marlin's block-scale factor, the largest input scale.
        self._marlin_factors: dict[tuple[str, ...], float] = {}
        self._input_scales: dict[tuple[tuple[str, ...], str], torch.Tensor] = {}
        # gpt-oss's layout (``quant_method: mxfp4``, experts in ``*_blocks``/``*_scales``) declares no
        # format the rest of this reader knows: its weights are read as a release's are, weights only.
        # Every other checkpoint is one of fp4prep's exports (FP8 included, which no base release is).
        qc = self.config.get("quantization_config")
        gpt_oss = isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"
        release = release_of(self.config, str(directory)) if gpt_oss else None
        self.gpt_oss = BaseSource(directory) if release is not None and release.method == "mxfp4" else None
        self.source: TensorSource
        if self.gpt_oss is not None:
            self.source, self.quantized = self.gpt_oss, set()
            super().__init__(self.config, sorted(self.gpt_oss.names()), dtype, device)
            return
        self.declared = declared(self.config)
        self.source = TensorSource(directory)
        names = self.stored_names
        self.quantized = {n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")}
        dense = [n for n in sorted(names) if n.rpartition(".")[0] not in self.quantized]
        dense += [f"{m}.weight" for m in sorted(self.quantized)]
        super().__init__(self.config, dense, dtype, device)

    @cached_property
    def stored_names(self) -> set[str]:
        return set(self.source.names())

    @cached_property
    def activations(self) -> dict[str, ActivationQuant]:
        names = self.stored_names
        return {m: q for m in sorted(self.quantized) if (q := self._activation_quant(m, names))}

    def model_activations(self) -> tuple[dict[str, ActivationQuant], dict[str, list[ActivationQuant]]]:
        """The input quantization by the model's names: of each quantized Linear module, and per
        expert of each fused expert tensor (its first stored part's: engines quantize the input of
        an expert's gate and up projections once, with the gate's scale)."""
        activations = self.activations
        linear = {
            model[: -len(".weight")]: q
            for model, stored in self.names.plain.items()
            if stored.endswith(".weight") and (q := activations.get(stored[: -len(".weight")])) is not None
        }
        experts = {}
        for model, fused in self.names.fused.items():
            per_expert = fused.per_expert()
            if per_expert is not None:
                experts[model] = [activations.get(parts[0].removesuffix(".weight"), _identity) for parts in per_expert]
        return linear, experts

    def fp8_gemms(self) -> dict[str, str]:
        """The model's Linear modules the engine computes with its FP8 product (E4M3 weights per
        output channel, inputs quantized per token as they come: dense FP8 layers, also those of a
        mixed-precision checkpoint), each with its stored module; from now on their weights are
        read as codes (``formats.engine.fp8_linear`` applies the scales)."""
        if self.gpt_oss is not None or not self.declared.dynamic_inputs:
            return {}
        names = self.stored_names
        gemms = {
            model[: -len(".weight")]: module
            for model, stored in self.names.plain.items()
            if stored.endswith(".weight") and (module := stored[: -len(".weight")]) in self.quantized
            and self.source.stored_dtype(f"{module}.{self.declared.layout.packed_name}") == torch.float8_e4m3fn
            and f"{module}.input_scale" not in names
        }
        self.as_codes.update(gemms.values())
        return gemms

    def fp8_expert_parts(self) -> dict[str, list[list[str]]]:
        """Per fused expert tensor of the model whose experts are FP8 with a static input scale (routed
        experts in an FP8 checkpoint), each expert's stored modules in the order they are stacked;
        from now on their weights are read as codes (``formats.engine.fp8_experts``)."""
        if self.gpt_oss is not None:
            return {}
        names, packed = self.stored_names, self.declared.layout.packed_name
        found = {}
        for model, fused in self.names.fused.items():
            per_expert = fused.per_expert()
            if per_expert is None:
                continue
            modules = [[part.removesuffix(".weight") for part in parts] for parts in per_expert]
            first = modules[0][0]
            if first in self.quantized and f"{first}.input_scale" in names \
                    and self.source.stored_dtype(f"{first}.{packed}") == torch.float8_e4m3fn:
                found[model] = modules
                self.as_codes.update(m for parts in modules for m in parts)
        return found

    def fp8_experts_forward(self, module: Any, name: str, parts: dict[str, list[list[str]]]) -> Callable[..., torch.Tensor]:
        """The forward of the experts module ``name`` (FP8, codes in its weights) as the engine computes it."""
        gate_up, down = parts[f"{name}.gate_up_proj"], parts[f"{name}.down_proj"]
        names = self.stored_names
        inputs = (self._group_input_scale(gate_up[0][0], "input_scale", names), self._group_input_scale(down[0][0], "input_scale", names))
        scales: dict[tuple[str, ...], torch.Tensor] = {}  # read once, when the expert first gets rows

        def scale(parts: list[str]) -> torch.Tensor:
            key = tuple(parts)
            if key not in scales:
                # One scale per expert and projection: the engine builds gate and up as one tensor.
                stored = [self.source.raw(f"{m}.weight_scale") for m in parts]
                if len({float(s) for s in stored}) != 1:
                    raise ValueError(f"{', '.join(parts)} store different FP8 scales, which the engine would requantize to their largest")
                scales[key] = stored[0].to(self.device)
            return scales[key]

        def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                return module.gate_up_proj[e], scale(gate_up[e]), module.down_proj[e], scale(down[e])

            scales = (inputs[0].to(hidden.device), inputs[1].to(hidden.device))
            return fp8_experts(hidden, top_k_index, top_k_weights, module.act_fn, expert, len(gate_up), scales)

        return forward

    def stored_shape(self, name: str) -> tuple[int, ...]:
        module = name.rpartition(".")[0]
        if module not in self.quantized or self.gpt_oss is not None:
            return self.source.shape(name)
        packed = f"{module}.{self.declared.layout.packed_name}"
        shape = self.source.shape(packed)
        e2m1 = self.declared.format.e2m1 and self.source.stored_dtype(packed) == torch.uint8
        return (*shape[:-1], shape[-1] * 2) if e2m1 else shape

    def stored(self, name: str) -> torch.Tensor:
        if self.gpt_oss is not None:
            return self.gpt_oss.get(name, self.dtype, self.device)
        module = name.rpartition(".")[0]
        if module not in self.quantized:
            return self.source.raw(name).to(self.device, self.dtype)
        layout, block_scale, source = self.declared.layout, self.declared.format.block_scale, self.source
        packed = source.raw(f"{module}.{layout.packed_name}").to(self.device)
        if module in self.as_codes:
            return packed.to(self.dtype)  # E4M3 codes are exact in BF16 and FP32
        scale = source.raw(f"{module}.weight_scale").to(self.device)
        if packed.dtype == torch.float8_e4m3fn:  # FP8, also the FP8 layers of a mixed-precision checkpoint
            weight = dequantize_fp8(packed, scale)
        elif block_scale == "e4m3":
            g_name = "weight_global_scale" if layout.reciprocal_globals else "weight_scale_2"
            g = _scalar(source.raw(f"{module}.{g_name}"))
            if self.numerics == NVFP4_W4A16.key:
                scale = marlin_floor(scale, self._marlin_factor(module))
            weight = dequantize_nvfp4(packed, scale, 1.0 / g if layout.reciprocal_globals else g)
        else:
            weight = dequantize_mxfp4(packed, scale)
        return weight.to(self.dtype)

    def _marlin_factor(self, module: str) -> float:
        """Marlin's power-of-two rescaling of a layer's block scales, from the largest of the layer
        vLLM builds around ``module`` (a fused q/k/v or gate/up group; a routed-expert projection's
        counterparts in every expert of its layer)."""
        group = self.layers.get(module, (module,))
        if group not in self._marlin_factors:
            largest = max(float(self.source.raw(f"{m}.weight_scale").float().max()) for m in group)
            self._marlin_factors[group] = marlin_scale_factor(largest)
        return self._marlin_factors[group]

    @cached_property
    def layers(self) -> dict[str, tuple[str, ...]]:
        return engine_layers(self.quantized)

    def _group_input_scale(self, module: str, leaf: str, names: set[str], smallest: bool = False) -> torch.Tensor:
        """The largest input scale stored for the engine layer of ``module`` (``smallest``: the smallest)."""
        group = tuple(m for m in self.layers.get(module, (module,)) if f"{m}.{leaf}" in names) or (module,)
        key = (group, leaf + "<" * smallest)
        if key not in self._input_scales:
            reduce = torch.amin if smallest else torch.amax
            self._input_scales[key] = reduce(torch.stack([reduce(self.source.raw(f"{m}.{leaf}").float()) for m in group]))
        return self._input_scales[key]

    def _activation_quant(self, module: str, names: set[str]) -> ActivationQuant | None:
        fmt, layout, source = self.declared.format, self.declared.layout, self.source
        fp8 = source.stored_dtype(f"{module}.{layout.packed_name}") == torch.float8_e4m3fn
        served = by_key(self.numerics)
        if served is not None and not fp8:  # the engine's numerics on the serving hardware
            expert = fnmatch.fnmatchcase(module, ROUTED_EXPERTS)
            if served.fp4_inputs == "" or (served.fp4_inputs == "dense" and expert):
                return None
            if fmt.block_scale == "e8m0":
                return mxfp4_activations
        if fmt.block_scale == "e4m3" and not fp8:
            i_name = "input_global_scale" if layout.reciprocal_globals else "input_scale"
            if f"{module}.{i_name}" not in names:
                return None
            # vLLM takes one input scale for the layer it builds: for ModelOpt's input scales (the
            # reciprocal of the global scale), the largest stored for its fused shards (q/k/v, gate/up)
            # and, for routed experts, over every expert of the layer. compressed-tensors stores the
            # global scale itself: vLLM takes the largest of a dense layer's shards
            # (``CompressedTensorsW4A4Fp4``) but the smallest of the routed experts' (the largest of
            # their reciprocals, ``convert_to_nvfp4_moe_kernel_format``): the expert that saw the
            # loudest input sets the scale.
            expert = fnmatch.fnmatchcase(module, ROUTED_EXPERTS)
            stored = self._group_input_scale(module, i_name, names, smallest=layout.reciprocal_globals and expert)
            scale = stored if layout.reciprocal_globals else nvfp4_global_scale(stored)
            return partial(nvfp4_activations, global_scale=scale.to(self.device), block_size=fmt.block_size)
        if fmt.block_scale == "e8m0" and not fp8:
            # Declared or not, MXFP4 inputs are quantized only where vLLM runs FlashInfer's W4A4.
            return mxfp4_activations if self.declared.dynamic_inputs else None
        # A stored input scale is static whatever the checkpoint declares (routed experts' FP8).
        if f"{module}.input_scale" in names:  # one scale for the engine's layer: the experts' largest
            return partial(fp8_static_activations, scale=self._group_input_scale(module, "input_scale", names).to(self.device))
        if self.declared.dynamic_inputs:
            return fp8_per_token_activations
        return None



def marlin_scale_factor(largest: float) -> float:
    """The power of two Marlin multiplies a layer's E4M3 block scales by so that the largest nears
    448 (``_nvfp4_compute_scale_factor``); 1 where it is there already."""
    if largest <= 0 or largest >= E4M3_MAX:
        return 1.0
    return float(2.0 ** math.floor(math.log2(E4M3_MAX / largest)))


def marlin_floor(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """The block scales as Marlin keeps them: zero where ``scale * factor * 2^7`` is under 2 (its
    S0E5M3 form has no room for them: ``nvfp4_marlin_process_scales``)."""
    kept = scale.float() * factor * 128 >= 2
    return torch.where(kept, scale.float(), 0.0).to(scale.dtype)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _quantized_experts_forward(
    experts: Any, gate_up_quant: list[ActivationQuant], down_quant: list[ActivationQuant]
) -> Callable[..., torch.Tensor]:
    """transformers' loop over stacked experts with each expert's input quantization, as engines run it.
    An expert's rows come in transformers' order (by slot, then token), so that its matrix products
    round as the calibrated model's did."""

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            slot, token_idx = torch.where((top_k_index == e).T)
            if token_idx.numel() == 0:
                continue
            x = gate_up_quant[e](hidden[token_idx])
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = down_quant[e](experts.act_fn(gate) * up)
            y = torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


def load(
    directory: Path, compute: Compute, quantize_activations: bool = True, numerics: str | None = None
) -> torch.nn.Module:
    """The checkpoint as a model that computes what a serving engine computes, one layer at a time
    (in ``numerics`` where given: the engine's on hardware that runs other than declared)."""
    weights = DequantizedWeights(directory, compute.dtype, compute.device, numerics)
    linear, experts = weights.model_activations() if quantize_activations else ({}, {})
    fp8 = weights.fp8_gemms() if quantize_activations else {}
    fp8_parts = weights.fp8_expert_parts() if quantize_activations else {}

    def engine_numerics(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if name in fp8:
                scale = partial(weights.source.raw, f"{fp8[name]}.weight_scale")
                module.forward = lambda x, m=module, s=scale: fp8_linear(x, m.weight, s().to(x.device), m.bias)
            elif name in linear:
                module.register_forward_pre_hook(lambda m, args, q=linear[name]: (q(args[0]),) + tuple(args[1:]))
            gate_up = getattr(module, "gate_up_proj", None)
            gu, down = experts.get(f"{name}.gate_up_proj"), experts.get(f"{name}.down_proj")
            if f"{name}.gate_up_proj" in fp8_parts and f"{name}.down_proj" in fp8_parts:
                module.forward = weights.fp8_experts_forward(module, name, fp8_parts)
            elif isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and (gu or down):
                n = gate_up.shape[0]
                module.forward = _quantized_experts_forward(module, gu or [_identity] * n, down or [_identity] * n)

    return streaming.build(weights.config, weights, compute, directory, before_hooks=engine_numerics)
