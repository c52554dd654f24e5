from __future__ import annotations

from pathlib import Path
from typing import Any

from fp4prep.pipeline import PipelineConfig, PipelineResult, Thresholds, run

# Random tiny models have near-uniform outputs: behaviour thresholds are the demo's business.
# The reload check stays strict: the independent reader must reproduce the calibrated model.
TINY = Thresholds(
    continuation_top1=0.0, answer_kl=1.0, identical_greedy=0.0, adapter_retention=0.5, reload_max_logit_diff=1e-3
)


def run_tiny(base: Path, out: Path, quantization: str = "nvfp4", **kwargs: Any) -> PipelineResult:
    options: dict[str, Any] = {
        "calibration_tokens": 2048,
        "sequence_length": 128,
        "parity_prompts": 3,
        "continuation_tokens": 6,
        "thresholds": TINY,
    }
    options.update(kwargs)
    return run(PipelineConfig(base_dir=base, output_dir=out, quantization=quantization, **options))
