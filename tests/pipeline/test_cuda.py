"""The pipeline on a CUDA device: ModelOpt's own kernels calibrate, compute is BF16, one layer at a
time on the GPU. Skipped without CUDA; ``bin/gpu-check`` runs them on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4prep.pipeline import Cancelled, device
from tests.tiny import save_adapter

from .helpers import run_tiny
from .model.test_streaming import cancel_at, checkpoint_bytes, six_layer_base

pytestmark = pytest.mark.cuda


def test_auto_picks_the_gpu_and_computes_in_bf16() -> None:
    compute = device.resolve("auto")
    assert compute.device == torch.device("cuda", 0) and compute.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("arch", "quantization"),
    [("llama", "nvfp4"), ("llama", "mxfp4"), ("llama", "fp8"), ("glm4_moe", "nvfp4"), ("deepseek_v3", "nvfp4")],
)
def test_the_pipeline_runs_on_the_gpu_with_modelopts_kernels(
    make_base, tmp_path: Path, calibration_file: Path, arch: str, quantization: str
) -> None:
    base = make_base(arch)
    adapter = save_adapter(base, tmp_path / "adapter", targets=["o_proj"], b_scale=0.05)
    result = run_tiny(
        base, tmp_path / "out", quantization, adapter_dir=adapter, calibration_file=calibration_file, device="cuda"
    )
    assert result.device.startswith("cuda:0") and result.device.endswith("bfloat16")
    # ModelOpt's kernels calibrated; the reader follows the export's arithmetic: they must agree.
    assert result.reload_max_logit_diff <= 1e-3
    assert result.retention is not None and result.retention.pooled > 0.8


def test_a_gpu_run_resumes_to_the_same_bytes(tokenizer_dir: Path, tmp_path: Path, calibration_file: Path) -> None:
    # Six layers, as on the CPU: stopped halfway, a run has finished layers to resume from.
    base = six_layer_base(tmp_path / "base", tokenizer_dir)
    straight = run_tiny(base, tmp_path / "straight", calibration_file=calibration_file, device="cuda")
    progress, should_cancel = cancel_at("calibrating", 0.5)
    with pytest.raises(Cancelled):
        run_tiny(
            base, tmp_path / "resumed", calibration_file=calibration_file, device="cuda",
            work_dir=tmp_path / "work", progress=progress, should_cancel=should_cancel,
        )
    resumed = run_tiny(
        base, tmp_path / "resumed", calibration_file=calibration_file, device="cuda", work_dir=tmp_path / "work"
    )
    assert resumed.resumed_from_layer is not None and 0 < resumed.resumed_from_layer < 6
    assert checkpoint_bytes(tmp_path / "resumed") == checkpoint_bytes(tmp_path / "straight")
    assert resumed.parity == straight.parity


def test_gpu_memory_does_not_grow_with_depth(tmp_path: Path, tokenizer_dir: Path) -> None:
    # As on the host (test_streaming): the same run on 4 and 20 layers; the 16 extra layers must add
    # less than a quarter of their BF16 size to the GPU's peak. Peaks are kept per stage, so that a
    # failure says which stage holds more than a layer.
    from .bases import random_llama

    hidden, intermediate = 1024, 4096
    layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    peaks: dict[int, dict[str, int]] = {}
    for layers in (4, 20):
        base = random_llama(tmp_path / f"base{layers}", tokenizer_dir, layers, hidden, intermediate)
        stages: dict[str, int] = {}

        def progress(stage: str, _fraction: float, stages: dict[str, int] = stages) -> None:
            stages[stage] = max(stages.get(stage, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

        torch.cuda.reset_peak_memory_stats()
        run_tiny(base, tmp_path / f"out{layers}", device="cuda", quality_gate=False, progress=progress)
        peaks[layers] = stages
    growth = max(peaks[20].values()) - max(peaks[4].values())
    assert growth < 16 * layer / 4, {n: {s: p >> 20 for s, p in by.items()} for n, by in peaks.items()}


def test_two_gpu_runs_in_one_process_write_the_same_bytes(llama_base: Path, tmp_path: Path, calibration_file: Path) -> None:
    # The first run measures its calibrated model in the checkpoint's numerics (ModelOpt's static-
    # scale kernel swapped for ours); the swap ends with it, so the second calibrates with ModelOpt's.
    first = run_tiny(llama_base, tmp_path / "first", calibration_file=calibration_file, device="cuda")
    second = run_tiny(llama_base, tmp_path / "second", calibration_file=calibration_file, device="cuda")
    assert checkpoint_bytes(tmp_path / "first") == checkpoint_bytes(tmp_path / "second")
    assert first.parity == second.parity
