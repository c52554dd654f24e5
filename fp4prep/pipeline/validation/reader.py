"""An independent reader of the checkpoints we write: our own decoding, not ModelOpt's.

It dequantizes the safetensors into a dense transformers model, one tensor at a time as each layer
runs, and, where the format quantizes activations, quantizes each layer's input as the serving
engine does (``formats.engine``, from the stored input scales). The model it returns computes what the
checkpoint describes, so its logits are compared with the calibrated fake-quant model's and, in
parity, with the BF16 model's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch

from ..device import Compute
from ..formats import declared
from ..formats.engine import (
    fp8_per_token_activations,
    fp8_static_activations,
    mxfp4_activations,
    nvfp4_activations,
    nvfp4_global_scale,
)
from ..formats.numerics import (
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from ..model import streaming
from ..model.lazy import LazyWeights
from ..model.releases import BaseSource, release_of
from ..model.safetensors import TensorSource, read_config
from ..serving import MXFP4_W4A4

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
        self.config = read_config(directory)
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
        names = set(self.source.names())
        self.quantized = {n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")}
        dense = [n for n in sorted(names) if n.rpartition(".")[0] not in self.quantized]
        dense += [f"{m}.weight" for m in sorted(self.quantized)]
        super().__init__(self.config, dense, dtype, device)

    @cached_property
    def activations(self) -> dict[str, ActivationQuant]:
        names = set(self.source.names())
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
            if per_expert is None:
                continue
            shared = self.expert_fp8_inputs(per_expert)
            if shared is not None:
                experts[model] = [shared] * len(per_expert)
            else:
                experts[model] = [activations.get(parts[0].removesuffix(".weight"), _identity) for parts in per_expert]
        return linear, experts

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
        scale = source.raw(f"{module}.weight_scale").to(self.device)
        if packed.dtype == torch.float8_e4m3fn:  # FP8, also in a mixed-precision checkpoint
            return dequantize_fp8(packed, scale).to(self.dtype)
        if block_scale == "e4m3":
            g_name = "weight_global_scale" if layout.reciprocal_globals else "weight_scale_2"
            g = _scalar(source.raw(f"{module}.{g_name}"))
            weight = dequantize_nvfp4(packed, scale, 1.0 / g if layout.reciprocal_globals else g)
        elif block_scale == "e8m0":
            weight = dequantize_mxfp4(packed, scale)
        else:
            weight = dequantize_fp8(packed, scale)
        return weight.to(self.dtype)

    def _activation_quant(self, module: str, names: set[str]) -> ActivationQuant | None:
        fmt, layout, source = self.declared.format, self.declared.layout, self.source
        fp8 = source.stored_dtype(f"{module}.{layout.packed_name}") == torch.float8_e4m3fn
        if fmt.block_scale == "e4m3" and not fp8:
            i_name = "input_global_scale" if layout.reciprocal_globals else "input_scale"
            if f"{module}.{i_name}" not in names:
                return None
            stored = source.raw(f"{module}.{i_name}").float()
            # compressed-tensors stores the engine's global scale itself, ModelOpt its reciprocal.
            scale = stored.max() if layout.reciprocal_globals else nvfp4_global_scale(stored)
            return partial(nvfp4_activations, global_scale=scale.to(self.device), block_size=fmt.block_size)
        if fmt.block_scale == "e8m0" and not fp8:
            # Declared or not, MXFP4 inputs are quantized only where vLLM runs FlashInfer's W4A4.
            return mxfp4_activations if self.numerics == MXFP4_W4A4.key or self.declared.dynamic_inputs else None
        # A stored input scale is static whatever the checkpoint declares (routed experts' FP8).
        if f"{module}.input_scale" in names:
            return partial(fp8_static_activations, scale=source.raw(f"{module}.input_scale").to(self.device))
        if self.declared.dynamic_inputs:
            return fp8_per_token_activations
        return None

    def expert_fp8_inputs(self, per_expert: list[list[str]]) -> ActivationQuant | None:
        """The static FP8 input quantization of one projection of a layer's routed experts as vLLM
        runs it: one scale for all of them, the largest stored (``ModelOptFp8MoEMethod``)."""
        names = [f"{parts[0].removesuffix('.weight')}.input_scale" for parts in per_expert]
        stored = set(self.source.names())
        packed = [f"{parts[0].removesuffix('.weight')}.{self.declared.layout.packed_name}" for parts in per_expert]
        fp8 = all(n in stored and self.source.stored_dtype(n) == torch.float8_e4m3fn for n in packed)
        if not fp8 or not all(n in stored for n in names):
            return None
        scale = torch.stack([self.source.raw(n).float().reshape(()) for n in names]).max()
        return partial(fp8_static_activations, scale=scale.to(self.device))


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

    def engine_numerics(model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            if name in linear:
                module.register_forward_pre_hook(lambda m, args, q=linear[name]: (q(args[0]),) + tuple(args[1:]))
            gate_up = getattr(module, "gate_up_proj", None)
            gu, down = experts.get(f"{name}.gate_up_proj"), experts.get(f"{name}.down_proj")
            if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and (gu or down):
                n = gate_up.shape[0]
                module.forward = _quantized_experts_forward(module, gu or [_identity] * n, down or [_identity] * n)

    return streaming.build(weights.config, weights, compute, directory, before_hooks=engine_numerics)
