"""The adapter's change survives when merged in BF16 first, and the retention check catches the
wrong order: merging into weights that are already FP4 snaps the change back to the base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline import PipelineError
from fp4prep.pipeline.formats import numerics
from tests.tiny import save_adapter

from ..helpers import run_tiny

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def snap_to_nvfp4(base: Path) -> None:
    """Rewrite the base's Linear weights as an NVFP4 release dequantized to BF16 would hold them."""
    path = base / "model.safetensors"
    weights = load_file(str(path))
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            weights[name] = numerics.nvfp4_fake_quant(w, 16, w.abs().amax())
    save_file(weights, str(path), metadata={"format": "pt"})


def test_merging_in_bf16_first_keeps_the_adapters_change(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, b_scale=0.002)
    result = run_tiny(llama_base, tmp_path / "out", adapter_dir=adapter)
    assert result.retention is not None
    assert 0.9 < result.retention.pooled < 1.1
    assert len(result.retention.per_tensor) == 14


def test_merging_into_weights_already_in_fp4_is_caught(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, b_scale=0.002)
    snap_to_nvfp4(llama_base)
    with pytest.raises(PipelineError, match=r"only -?0\.\d\d of the adapter's change survived quantization"):
        run_tiny(llama_base, tmp_path / "out", adapter_dir=adapter)
    assert not (tmp_path / "out").exists()


def test_the_adapters_change_is_mostly_below_half_an_fp4_step(llama_base: Path, tmp_path: Path) -> None:
    """The premise of merging first, measured on this adapter: most changes can't move a code."""
    from fp4prep.pipeline.model import merge
    from fp4prep.pipeline.model.safetensors import TensorSource

    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, b_scale=0.002)
    source = TensorSource(llama_base)
    updates, _ = merge.plan(merge.load_adapter(adapter), source)
    below = total = 0
    for update in updates:
        w = source.get(update.target, torch.float32)
        scales, scale_2 = numerics.nvfp4_scales(w, 16, w.abs().amax())
        half_step = (scales * scale_2).repeat_interleave(16, -1) * 0.25  # E2M1's finest step is 0.5
        below += int((update.delta().abs() < half_step).sum())
        total += w.numel()
    assert below / total > 0.5
