"""Why merge first, measured on the demo: the adapter merged into BF16 weights vs into weights
that are already FP4 (the base snapped to the NVFP4 grid, as an FP4 release holds it).

Prints, for each order, the share of the adapter's change that survived NVFP4 quantization and
the adapter task's success rate on the quantized model.

    .venv/bin/python benchmarks/merge_order.py
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main() -> None:
    from safetensors.torch import load_file, save_file

    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, Thresholds, run
    from fp4prep.pipeline.formats import numerics

    assets = demo.build()
    # Measure, don't gate: the wrong order is expected to fail the retention threshold.
    measure = Thresholds(
        continuation_top1=0, answer_kl=1e9, identical_greedy=0, adapter_retention=-1e9, reload_max_logit_diff=1e-3
    )
    with tempfile.TemporaryDirectory() as tmp:
        snapped = Path(tmp) / "fp4-base"
        shutil.copytree(assets.base_dir, snapped)
        weights = load_file(str(snapped / "model.safetensors"))
        for name, w in weights.items():
            if name.endswith("_proj.weight"):
                weights[name] = numerics.nvfp4_fake_quant(w, 16, w.abs().amax())
        save_file(weights, str(snapped / "model.safetensors"), metadata={"format": "pt"})
        for label, base in (
            ("merged into BF16, then NVFP4", assets.base_dir),
            ("merged into FP4 weights, then NVFP4", snapped),
        ):
            result = run(
                PipelineConfig(
                    base_dir=base,
                    adapter_dir=assets.adapter_dir,
                    calibration_file=assets.calibration_file,
                    user_token_minimum=4096,
                    output_dir=Path(tmp) / label.replace(" ", "-"),
                    thresholds=measure,
                )
            )
            assert result.retention is not None and result.task is not None
            print(
                f"{label:<38} change retained {result.retention.pooled:6.3f}   "
                f"task success BF16 merged {result.task.bf16_success:4.0%} -> NVFP4 {result.task.quantized_success:4.0%}"
            )


if __name__ == "__main__":
    main()
