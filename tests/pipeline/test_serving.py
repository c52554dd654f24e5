"""Which GPUs run a checkpoint other than it declares (vLLM 0.33: MXFP4 is W4A4 on Blackwell)."""

from __future__ import annotations

import pytest

from fp4prep.pipeline.serving import MXFP4_W4A4, numerics_on, profiles_to_measure


@pytest.mark.parametrize(
    ("quantization", "hardware", "expected"),
    [
        ("mxfp4", "NVIDIA B200", MXFP4_W4A4),
        ("MXFP4", "nvidia gb300 nvl72", MXFP4_W4A4),
        ("mxfp4", "NVIDIA RTX PRO 6000 Blackwell", MXFP4_W4A4),
        ("mxfp4", "NVIDIA H200", None),
        ("mxfp4", "NVIDIA RTX 5000 Ada", None),
        ("nvfp4", "NVIDIA B200", None),
        ("fp8", "NVIDIA B200", None),
    ],
)
def test_only_mxfp4_on_blackwell_runs_other_than_declared(quantization: str, hardware: str, expected: object) -> None:
    assert numerics_on(quantization, hardware) == expected


def test_each_numerics_is_measured_once_for_all_the_hardware_that_runs_it() -> None:
    measured = profiles_to_measure("mxfp4", ["NVIDIA H200", "NVIDIA B200", "NVIDIA GB200", "NVIDIA H100"])
    assert measured == [(MXFP4_W4A4, ["NVIDIA B200", "NVIDIA GB200"])]
    assert profiles_to_measure("nvfp4", ["NVIDIA B200"]) == []
    assert profiles_to_measure("mxfp4", []) == []
