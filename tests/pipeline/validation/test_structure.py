"""Structural validation refuses a checkpoint whose files are wrong, naming the tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline import PipelineError
from fp4prep.pipeline.formats import FORMATS
from fp4prep.pipeline.validation import structure

from ..helpers import run_tiny

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from tests.tiny import save_tiny_base

    root = tmp_path_factory.mktemp("structure")
    run_tiny(save_tiny_base(root / "base", "llama", tokenizer_dir), root / "out")
    return root / "out"


def tampered(src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    change(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_untouched_checkpoint_passes(nvfp4_checkpoint: Path) -> None:
    checks = structure.structure(nvfp4_checkpoint, FORMATS["nvfp4"], bf16_bytes=1)
    assert checks[0] == "format nvfp4 declared and written (14 quantized modules)"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda w: w.__setitem__(
                f"{Q}.weight_scale", torch.full_like(w[f"{Q}.weight_scale"], float("nan"))
            ),
            f"{Q}: scales must be finite and non-zero",
        ),
        (lambda w: w.pop(f"{Q}.input_scale"), f"{Q}: input_scale is missing"),
        (
            lambda w: w.__setitem__(f"{Q}.weight_scale_2", w[f"{Q}.weight_scale_2"] * 2),
            "model.layers.0.self_attn: fused q_proj/k_proj/v_proj have different global scales",
        ),
        (
            lambda w: w.__setitem__(f"{Q}.weight", w[f"{Q}.weight"].view(torch.float8_e4m3fn)),
            f"{Q}: FP4 weights stored as torch.float8_e4m3fn, not packed uint8",
        ),
        (
            lambda w: (
                [w.pop(f"{Q}.{k}") for k in ("weight_scale", "weight_scale_2", "input_scale")]
                and w.__setitem__(f"{Q}.weight", torch.zeros(64, 64, dtype=torch.bfloat16))
            ),
            f"{Q} is left in BF16 but not listed as excluded",
        ),
        (
            # vLLM runs q/k/v as one layer with one input scale, the largest of the three.
            lambda w: w.__setitem__(f"{Q}.input_scale", w[f"{Q}.input_scale"] / 2),
            f"{Q} and model.layers.0.self_attn.k_proj store different input_scales",
        ),
    ],
    ids=["nan-scale", "missing-input-scale", "unshared-global", "fp8-not-packed", "unlisted-bf16", "unshared-input"],
)
def test_a_broken_checkpoint_is_refused(nvfp4_checkpoint: Path, tmp_path: Path, change, message: str) -> None:
    broken = tampered(nvfp4_checkpoint, tmp_path / "broken", change)
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        structure.structure(broken, FORMATS["nvfp4"], bf16_bytes=1)


def test_a_checkpoint_of_another_format_than_the_recipe_is_refused(nvfp4_checkpoint: Path) -> None:
    with pytest.raises(PipelineError, match="declares nvfp4, the recipe is fp8"):
        structure.structure(nvfp4_checkpoint, FORMATS["fp8"], bf16_bytes=1)
