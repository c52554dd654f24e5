"""Which GPUs run a checkpoint other than it declares (vLLM 0.33: MXFP4 is W4A4 on Blackwell, its
routed experts weights-only on compute capability 12; NVFP4 is weights-only below Blackwell)."""

from __future__ import annotations

import pytest

from fp4prep.pipeline.serving import (
    MXFP4_W4A4,
    MXFP4_W4A4_DENSE,
    NVFP4_W4A16,
    numerics_on,
    profiles_to_measure,
)


@pytest.mark.parametrize(
    ("quantization", "hardware", "expected"),
    [
        ("mxfp4", "NVIDIA B200", MXFP4_W4A4),
        ("MXFP4", "nvidia gb300 nvl72", MXFP4_W4A4),
        ("mxfp4", "NVIDIA RTX PRO 6000 Blackwell", MXFP4_W4A4_DENSE),
        ("mxfp4", "NVIDIA GeForce RTX 5090", MXFP4_W4A4_DENSE),
        ("mxfp4", "NVIDIA H200", None),
        ("mxfp4", "NVIDIA RTX 5000 Ada", None),
        ("nvfp4", "NVIDIA B200", None),
        ("nvfp4", "NVIDIA RTX PRO 6000 Blackwell", None),
        ("nvfp4", "NVIDIA H200", NVFP4_W4A16),
        ("nvfp4", "NVIDIA A100 80GB", NVFP4_W4A16),
        ("fp8", "NVIDIA B200", None),
        ("fp8", "NVIDIA H100", None),
    ],
)
def test_the_engine_numerics_follow_the_gpu(quantization: str, hardware: str, expected: object) -> None:
    assert numerics_on(quantization, hardware) == expected


def test_each_numerics_is_measured_once_for_all_the_hardware_that_runs_it() -> None:
    measured = profiles_to_measure("mxfp4", ["NVIDIA H200", "NVIDIA B200", "NVIDIA GB200", "NVIDIA H100"])
    assert measured == [(MXFP4_W4A4, ["NVIDIA B200", "NVIDIA GB200"])]
    assert profiles_to_measure("nvfp4", ["NVIDIA B200"]) == []
    assert profiles_to_measure("nvfp4", ["NVIDIA H200", "NVIDIA B200", "NVIDIA H100"]) == [
        (NVFP4_W4A16, ["NVIDIA H200", "NVIDIA H100"])
    ]
    assert profiles_to_measure("mxfp4", []) == []



def test_the_gate_holds_what_a_gpu_runs_when_no_setting_avoids_it(tmp_path, tokenizer_dir) -> None:
    # NVFP4 on Hopper runs weights-only and vLLM has no W4A4 kernel to ask for there: a job served on
    # an H200 alone is held to what the H200 computes (and only that), named as such.
    import dataclasses

    from fp4prep.pipeline import PipelineError
    from tests.tiny import save_tiny_base, write_conversations

    from .helpers import TINY, run_tiny

    base = save_tiny_base(tmp_path / "base", "llama", tokenizer_dir)
    strict = dataclasses.replace(TINY, continuation_top1=1.01)  # no checkpoint reaches it
    with pytest.raises(PipelineError, match=r"thresholds: served on NVIDIA H200 \(nvfp4-w4a16\): top-1 agreement on the BF16 model's own continuations [01]\.\d+ < 1\.01$"):
        run_tiny(base, tmp_path / "out", "nvfp4", serving_hardware=["NVIDIA H200"], thresholds=strict,
                 calibration_file=write_conversations(tmp_path / "calibration.jsonl", 120))
