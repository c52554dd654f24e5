"""The fixed quantization recipe of each output format, and the bar its checkpoint must clear.

Users choose a format, never the knobs: each recipe pins ModelOpt's config, what stays in BF16,
the on-disk layout and the validation thresholds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# Kept in BF16 whatever ModelOpt's defaults say: the output head, embeddings, norms (never
# Linear, so never quantized) and MoE routers.
BF16_PATTERNS = ("*lm_head*", "*embed_tokens*", "*mlp.gate.*", "*router*", "*shared_expert_gate*")


@dataclass(frozen=True)
class Thresholds:
    """Minimum behaviour a checkpoint must show against the BF16 merged model.

    The defaults per recipe were set from the embedded demo (SmolLM2-135M, where 4-bit costs the
    most) with margin; the reload bound is tight because on the CPU the reader is bit-exact.
    """

    continuation_top1: float  # on the BF16 model's own greedy continuations, at least
    answer_kl: float  # nats per token on the assistant turns, at most
    identical_greedy: float
    adapter_retention: float  # pooled least-squares coefficient, at least
    reload_max_logit_diff: float  # independent reader vs calibrated fake-quant model, at most


@dataclass(frozen=True)
class Recipe:
    name: str
    modelopt_config: str  # attribute of modelopt.torch.quantization
    block_size: int | None
    layout: str  # what export writes: "modelopt" or "compressed-tensors"
    quant_algo: str  # the algorithm the checkpoint declares
    weight_bits: float  # storage bits per quantized weight, scales included
    activations_quantized: bool
    thresholds: Thresholds
    # ModelOpt's calibration algorithm, when it is not the config's own (awq_lite, or our fold_awq).
    algorithm: dict[str, Any] | None = None
    # The algorithm changes weights (AWQ smooths them): layerwise calibration writes each layer
    # back, and the stored weights are no longer the merged ones.
    mutates_weights: bool = False
    # AWQ's pre_quant_scale folded into norms and projections before export (engines run none).
    folds_pre_quant_scale: bool = False
    # NVFP4 weight block scales fixed by calibration (GPTQ rounds against them) rather than taken
    # from each block's maximum when exported; the checkpoint holds them the same way.
    static_weight_scales: bool = False

    @property
    def calibration(self) -> str:
        """How the quantizers are calibrated, in words (the model card and ``fp4prep.json`` say it)."""
        algorithm = self.algorithm or {}
        searched = algorithm.get("method") != "fold_awq" or algorithm.get("awq", True)
        words = str(algorithm.get("method", "max")) if searched else "max"
        if searched and "alpha_step" in algorithm:
            words += f" (alpha step {algorithm['alpha_step']})"
        if self.folds_pre_quant_scale:
            words += ", scales folded into the preceding norms and projections"
        if algorithm.get("gptq"):
            words += ", then GPTQ against " + ("static weight scales" if self.static_weight_scales else "each block's own scale")
        return words

    def quant_config(self, use_cpu_backend: bool) -> dict[str, Any]:
        """ModelOpt's config for this recipe, our BF16 exclusions appended."""
        import modelopt.torch.quantization as mtq

        from . import fakequant

        config = copy.deepcopy(getattr(mtq, self.modelopt_config))
        entries = config["quant_cfg"]
        for entry in entries:
            cfg = entry.get("cfg")
            if not isinstance(cfg, dict):
                continue
            if use_cpu_backend and fakequant.handles(cfg.get("num_bits")):
                cfg["backend"] = fakequant.BACKEND_NAME
            if self.static_weight_scales and entry.get("quantizer_name") == "*weight_quantizer":
                cfg["block_sizes"] = {**cfg["block_sizes"], "type": "static"}
        entries.extend({"quantizer_name": p, "enable": False} for p in BF16_PATTERNS)
        if not self.activations_quantized:
            entries.append({"quantizer_name": "*input_quantizer", "enable": False})
        if self.algorithm is not None:
            config["algorithm"] = copy.deepcopy(self.algorithm)
        return config


RECIPES: dict[str, Recipe] = {
    "nvfp4": Recipe(
        name="nvfp4",
        modelopt_config="NVFP4_DEFAULT_CFG",
        block_size=16,
        layout="modelopt",
        quant_algo="NVFP4",
        weight_bits=4.5,
        activations_quantized=True,
        # fold_awq (pipeline/awq.py): AWQ's per-channel scales, one per fold group, searched on the
        # W4A4 outputs engines compute and folded into the preceding norms and projections so that
        # engines run plain NVFP4; then GPTQ (pipeline/gptq.py) rounds each folded layer's weights
        # against static block scales, its Hessians from every second calibration token.
        algorithm={"method": "fold_awq", "alpha_step": 0.5, "gptq": True, "hessian_stride": 2},
        mutates_weights=True,
        folds_pre_quant_scale=True,
        static_weight_scales=True,
        thresholds=Thresholds(
            continuation_top1=0.9,
            answer_kl=0.3,
            identical_greedy=0.5,
            adapter_retention=0.5,
            reload_max_logit_diff=1e-3,
        ),
    ),
    "mxfp4": Recipe(
        name="mxfp4",
        # Weights only, as MXFP4 releases ship (gpt-oss: E2M1 weights, BF16 activations);
        # engines run it as W4A16 MXFP4.
        modelopt_config="MXFP4_DEFAULT_CFG",
        block_size=32,
        layout="compressed-tensors",
        quant_algo="mxfp4-pack-quantized",
        weight_bits=4.25,
        activations_quantized=False,
        # GPTQ (pipeline/gptq.py, inside fold_awq's layer pass with its AWQ search off): each
        # layer's weights rounded on their blocks' power-of-two grids with the Hessian of the BF16
        # inputs the engine multiplies them by, from every second calibration token.
        algorithm={"method": "fold_awq", "awq": False, "gptq": True, "hessian_stride": 2},
        mutates_weights=True,
        thresholds=Thresholds(
            continuation_top1=0.9,
            answer_kl=0.3,
            identical_greedy=0.4,
            adapter_retention=0.5,
            reload_max_logit_diff=1e-3,
        ),
    ),
    "fp8": Recipe(
        name="fp8",
        modelopt_config="FP8_PER_CHANNEL_PER_TOKEN_CFG",
        block_size=None,
        layout="modelopt",
        quant_algo="FP8_PER_CHANNEL_PER_TOKEN",
        weight_bits=8.0,
        activations_quantized=True,
        thresholds=Thresholds(
            continuation_top1=0.95,
            answer_kl=0.05,
            identical_greedy=0.6,
            adapter_retention=0.8,
            reload_max_logit_diff=1e-3,
        ),
    ),
}


def get_recipe(name: str) -> Recipe:
    from .errors import UserError

    try:
        return RECIPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown quantization {name!r}: choose one of {', '.join(RECIPES)}") from None
