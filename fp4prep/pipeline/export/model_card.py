"""What a checkpoint says about itself: its lineage as JSON (``fp4prep.json``) and a model card."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import PipelineConfig, PipelineResult
from ..formats.engine import VLLM_VERSION
from ..recipes import Recipe
from ..validation import report
from .versions import tool_versions

LINEAGE_FILE = "fp4prep.json"

# How each format is served, as far as fp4prep has checked it against the engine's code (vLLM
# 0.33.0's loaders and its activation arithmetic, which parity follows). transformers itself loads
# none of these layouts ("Unknown quantization type, got modelopt").
SERVING = {
    "nvfp4": [
        "vLLM reads this layout (ModelOpt's unified checkpoint, `quant_algo: NVFP4`) as it is:",
        "`vllm serve <this directory>`. On Blackwell weights and activations are FP4 (W4A4); the parity",
        "above was measured with each layer's input quantized exactly as vLLM 0.33 quantizes it. Below",
        "Blackwell (Hopper, Ada, Ampere) vLLM 0.33 runs it weights-only on Marlin (BF16 activations):",
        "where the job was told its GPUs, a \"Served on\" row above gives its figures measured that way.",
        "SGLang 0.5.23's loader takes the same config and tensors (`--quantization modelopt_fp4`; its",
        "activation arithmetic not checked); TensorRT-LLM reads ModelOpt's layout, its loader not checked.",
    ],
    "mxfp4": [
        "vLLM reads this layout (compressed-tensors, `mxfp4-pack-quantized`) as it is:",
        "`vllm serve <this directory>`. The checkpoint declares weights-only; vLLM 0.33 runs it so on",
        "Hopper (Marlin, BF16 activations), which the parity above measures, and W4A4 on Blackwell",
        "(FlashInfer quantizes each layer's input to MXFP4; on compute capability 12, RTX PRO 6000",
        "Blackwell or RTX 5090, routed experts stay weights-only on Marlin): where the job was told its",
        "GPUs, a \"Served on\" row above gives its figures measured that way. SGLang 0.5.23 has no",
        "scheme for MXFP4 dense layers (\"No compressed-tensors compatible scheme was found\").",
    ],
    "fp8": [
        "vLLM reads this layout (ModelOpt's unified checkpoint, `quant_algo: FP8_PER_CHANNEL_PER_TOKEN`,",
        "or `MIXED_PRECISION` with routed experts) as it is: `vllm serve <this directory>`; per-channel",
        "FP8 weights with activations quantized per token, and routed experts (vLLM's FP8 MoE method",
        "reads no other) per-tensor with one static input scale, exactly as the parity above measured",
        "them. SGLang 0.5.23 refuses per-channel layers (its ModelOpt FP8 path takes `quant_algo: FP8`",
        "only, with per-tensor scales); TensorRT-LLM reads ModelOpt's layout, its loader not checked.",
    ],
}


def lineage(config: PipelineConfig, recipe: Recipe, result: PipelineResult) -> dict[str, Any]:
    metrics = result.to_dict()
    if metrics.get("retention"):
        metrics["retention"] = {k: v for k, v in metrics["retention"].items() if k != "per_tensor"}
    return {
        "name": config.lineage.get("name"),
        "base": config.lineage.get("base", str(config.base_dir)),
        "adapter": config.lineage.get("adapter", str(config.adapter_dir) if config.adapter_dir else None),
        "calibration_sha256": result.corpus.calibration_sha256,
        "recipe": {
            "name": recipe.name,
            "modelopt_config": recipe.format.modelopt_config,
            # A release's scales are its own: only the rounding of the weights the adapter changed is ours.
            "calibration": recipe.calibration if result.release is None else "changed weights rounded " + result.release["rounding"],
            "quant_algo": recipe.format.declared,
            "layout": recipe.format.layout.name,
            # How calibration, the AWQ search and parity quantized each layer's input.
            "activation_arithmetic": f"vLLM {VLLM_VERSION}" if recipe.format.activations_quantized else None,
            "calibration_tokens": result.corpus.user_tokens + result.corpus.general_tokens,
            "sequence_length": config.sequence_length,
        },
        "metrics": {
            k: metrics[k]
            for k in (
                "parity", "retention", "task", "reload_max_logit_diff", "corpus", "expert_tokens", "expert_gptq", "reads", "release",
            )
        },
        "quality_gate": {"enforced": config.quality_gate, "misses": result.quality_misses},
        "device": result.device,
        "tools": tool_versions(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **{k: v for k, v in config.lineage.items() if k not in ("name", "base", "adapter")},
    }


def write(output_dir: Path, lineage: dict[str, Any], result: dict[str, Any]) -> None:
    """The lineage as JSON and as the checkpoint's README, with the run's report (``result``)."""
    (output_dir / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, default=str) + "\n")
    recipe = lineage["recipe"]
    release = result.get("release")
    how = [
        "Prepared by fp4prep: the adapter was merged into the base's BF16 weights, then the merged",
        "model was calibrated and quantized with NVIDIA ModelOpt.",
    ] if not release else [
        "Prepared by fp4prep from a base that ships in FP4, in the release's own format: the adapter was",
        "merged into the release's weights as the engine dequantizes them; "
        f"{release['copied']} tensors copied from the release byte for byte, {release['requantized']} quantized",
        f"weights the adapter changed given new codes on the release's own scales, {release['rewritten']} unquantized "
        "tensors it changed written merged.",
        f"The changed weights were rounded {release['rounding']}"
        + (f", keeping {release['kept_in_outputs']:.0%} of the adapter's change in the layers' outputs."
           if release.get("kept_in_outputs") is not None else "."),
    ]
    lines = [
        "---",
        f"tags: [fp4prep, {recipe['name']}, quantized, {recipe['layout']}]",
        "---",
        f"# {lineage.get('name') or 'Prepared model'} ({recipe['quant_algo']})",
        "",
        *how,
        "",
        "| | |",
        "|---|---|",
        f"| base | `{lineage.get('base')}` |",
        f"| adapter | `{lineage.get('adapter')}` |",
        f"| calibration file sha256 | `{lineage.get('calibration_sha256')}` |",
        f"| recipe | `{recipe['name']}` ({recipe['modelopt_config']}; calibration: {recipe['calibration']}) |",
        "",
        "## Measured against the BF16 merged model",
        "",
        *report.markdown(report.figures(result)),
        "",
        "## Serving",
        "",
        *SERVING.get(recipe["name"], []),
        "",
        "Tool versions: " + ", ".join(f"{k} {v}" for k, v in lineage.get("tools", {}).items()),
        "",
    ]
    (output_dir / "README.md").write_text("\n".join(lines))
