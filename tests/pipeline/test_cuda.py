"""The pipeline on a CUDA device: ModelOpt's own kernels calibrate, compute is BF16, one layer at a
time on the GPU. Skipped without CUDA; ``bin/gpu-check`` runs them on a GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4prep.pipeline import Cancelled, device
from tests.tiny import save_adapter

from .helpers import run_tiny
from .test_streaming import cancel_at, checkpoint_bytes

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


def test_a_gpu_run_resumes_to_the_same_bytes(llama_base: Path, tmp_path: Path, calibration_file: Path) -> None:
    straight = run_tiny(llama_base, tmp_path / "straight", calibration_file=calibration_file, device="cuda")
    progress, should_cancel = cancel_at("calibrating", 0.5)
    with pytest.raises(Cancelled):
        run_tiny(
            llama_base, tmp_path / "resumed", calibration_file=calibration_file, device="cuda",
            work_dir=tmp_path / "work", progress=progress, should_cancel=should_cancel,
        )
    resumed = run_tiny(
        llama_base, tmp_path / "resumed", calibration_file=calibration_file, device="cuda", work_dir=tmp_path / "work"
    )
    assert resumed.resumed_from_layer is not None
    assert checkpoint_bytes(tmp_path / "resumed") == checkpoint_bytes(tmp_path / "straight")
    assert resumed.parity == straight.parity


def test_the_gpu_holds_one_layer_at_a_time(tmp_path: Path, tokenizer_dir: Path) -> None:
    from .bases import random_llama

    hidden, intermediate, layers = 1024, 4096, 24
    base = random_llama(tmp_path / "base", tokenizer_dir, layers, hidden, intermediate)
    torch.cuda.reset_peak_memory_stats()
    run_tiny(base, tmp_path / "out", device="cuda", quality_gate=False)
    layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    whole = layers * layer
    peak = torch.cuda.max_memory_allocated()
    assert peak < whole / 2, (peak, whole)


def test_two_gpu_runs_in_one_process_write_the_same_bytes(llama_base: Path, tmp_path: Path, calibration_file: Path) -> None:
    # The first run measures its calibrated model in the checkpoint's numerics (ModelOpt's static-
    # scale kernel swapped for ours); the swap ends with it, so the second calibrates with ModelOpt's.
    first = run_tiny(llama_base, tmp_path / "first", calibration_file=calibration_file, device="cuda")
    second = run_tiny(llama_base, tmp_path / "second", calibration_file=calibration_file, device="cuda")
    assert checkpoint_bytes(tmp_path / "first") == checkpoint_bytes(tmp_path / "second")
    assert first.parity == second.parity
