"""Recipes beyond max calibration, on tiny models: AWQ folded away, static weight scales, GPTQ, and
the reload check that catches a calibrated model the engine would not reproduce."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp4prep.pipeline import PipelineError
from fp4prep.pipeline.recipes import RECIPES, Recipe
from tests.tiny import save_adapter

from .helpers import run_tiny

AWQ = {"algorithm": {"method": "fold_awq", "alpha_step": 0.25}, "mutates_weights": True, "folds_pre_quant_scale": True}
# ModelOpt's own AWQ: a scale per projection, so folding averages the norm groups' and undoes o_proj's.
AWQ_LITE = {**AWQ, "algorithm": {"method": "awq_lite", "alpha_step": 0.5}}
# o_proj's scale too, tied across query heads and folded into v_proj's rows.
AWQ_HEADS = {**AWQ, "algorithm": {**AWQ["algorithm"], "fold_attention_output": True}}
# AWQ, then GPTQ on the folded weights against static weight scales.
AWQ_GPTQ = {**AWQ, "algorithm": {**AWQ["algorithm"], "gptq": True}, "static_weight_scales": True}
# The config's own calibration (max, or the MSE sweep its name says), no AWQ.
OWN = {"algorithm": None, "mutates_weights": False, "folds_pre_quant_scale": False}


def variant(fmt: str, **changes: Any) -> Recipe:
    return dataclasses.replace(RECIPES[fmt], **changes)


def stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.parametrize(
    ("arch", "fmt", "awq"),
    [
        ("llama", "nvfp4", AWQ),
        ("glm4_moe", "nvfp4", AWQ),
        ("llama", "mxfp4", AWQ),
        ("llama", "nvfp4", AWQ_LITE),
        ("llama", "nvfp4", AWQ_HEADS),
        ("llama", "nvfp4", AWQ_GPTQ),
        ("glm4_moe", "nvfp4", AWQ_GPTQ),
        ("llama", "mxfp4", {**AWQ_GPTQ, "static_weight_scales": False}),  # MXFP4's scales are the blocks' own
    ],
    ids=["llama-nvfp4", "glm4_moe-nvfp4", "llama-mxfp4", "llama-nvfp4-awq_lite", "llama-nvfp4-o_proj",
         "llama-nvfp4-gptq", "glm4_moe-nvfp4-gptq", "llama-mxfp4-gptq"],
)
def test_awq_scales_are_folded_away_and_the_checkpoint_is_the_plain_format(
    make_base: Any, tmp_path: Path, calibration_file: Path, arch: str, fmt: str, awq: dict[str, Any]
) -> None:
    base = make_base(arch)
    targets = ["q_proj", "v_proj", "o_proj"] + (["gate_proj", "up_proj", "down_proj"] if arch == "llama" else [])
    adapter = save_adapter(base, tmp_path / "adapter", targets=targets, b_scale=0.05)
    out = tmp_path / "out"
    result = run_tiny(base, out, fmt, adapter_dir=adapter, calibration_file=calibration_file, recipe=variant(fmt, **awq))
    # The checkpoint declares the format engines load, carries no pre_quant_scale, and the
    # independent reader reproduces the calibrated (smoothed, folded) model exactly.
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config.get("quant_algo", config.get("format")) in ("NVFP4", "mxfp4-pack-quantized")
    tensors = stored(out)
    assert not [k for k in tensors if "pre_quant_scale" in k]
    assert result.reload_max_logit_diff == 0.0
    # The scales went into norms (which are BF16 in the checkpoint, no longer the base's) where the
    # search found one better than none ...
    base_tensors = stored(base)
    norms = [k for k in base_tensors if k.endswith("layernorm.weight")]
    assert [k for k in norms if not torch.equal(tensors[k], base_tensors[k])]
    # ... and the adapter's change is still measured right through them.
    assert result.retention is not None and result.retention.pooled > 0.9, result.retention


@pytest.mark.parametrize("recipe", [AWQ, AWQ_GPTQ], ids=["fold_awq", "fold_awq-gptq"])
def test_an_awq_run_stopped_midway_resumes_to_the_same_bytes(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, recipe: dict[str, Any]
) -> None:
    from transformers import AutoModelForCausalLM

    from fp4prep.pipeline import Cancelled
    from tests.tiny import tiny_config

    from .test_streaming import cancel_at, checkpoint_bytes

    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    for f in tokenizer_dir.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "down_proj"], b_scale=0.05)
    common = {"adapter_dir": adapter, "calibration_file": calibration_file, "recipe": variant("nvfp4", **recipe)}
    straight = run_tiny(base, tmp_path / "straight", **common)
    work = tmp_path / "work"
    progress, should_cancel = cancel_at("calibrating", 0.6)
    with pytest.raises(Cancelled):
        run_tiny(base, tmp_path / "resumed", work_dir=work, progress=progress, should_cancel=should_cancel, **common)
    assert any((work / "written").glob("*.safetensors"))  # the smoothed layers, kept for the resume
    resumed = run_tiny(base, tmp_path / "resumed", work_dir=work, **common)
    assert resumed.resumed_from_layer is not None and 0 < resumed.resumed_from_layer < 4
    assert checkpoint_bytes(tmp_path / "resumed") == checkpoint_bytes(tmp_path / "straight")
    assert resumed.reload_max_logit_diff == 0.0 and list(work.iterdir()) == []
    assert resumed.retention == straight.retention


@pytest.mark.parametrize(
    "changes",
    [
        {**OWN, "modelopt_config": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG"},
        {**OWN, "modelopt_config": "NVFP4_FOUR_OVER_SIX_CFG"},
        {**OWN, "modelopt_config": "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "algorithm": {"method": "gptq"}, "mutates_weights": True},
    ],
    ids=["mse", "four-over-six", "gptq"],
)
def test_static_weight_scales_run_on_the_cpu_and_reload_exactly(
    llama_base: Path, tmp_path: Path, calibration_file: Path, changes: dict[str, Any]
) -> None:
    # ModelOpt computes these with Triton kernels; here the CPU backend's torch versions run, and
    # the checkpoint ModelOpt exports from them must hold exactly what they computed.
    result = run_tiny(llama_base, tmp_path / "out", calibration_file=calibration_file, recipe=variant("nvfp4", **changes))
    assert result.reload_max_logit_diff == 0.0


@dataclasses.dataclass(frozen=True)
class ActivationBlocksOf32(Recipe):
    """NVFP4 with activations calibrated in blocks of 32: engines quantize them in blocks of 16."""

    def quant_config(self, use_cpu_backend: bool) -> dict[str, Any]:
        config = super().quant_config(use_cpu_backend)
        for entry in config["quant_cfg"]:
            if entry.get("quantizer_name") == "*input_quantizer" and isinstance(entry.get("cfg"), dict):
                entry["cfg"]["block_sizes"] = {**entry["cfg"]["block_sizes"], -1: 32}
        return config


def test_a_calibrated_model_the_engine_would_not_reproduce_fails_the_reload_check(llama_base: Path, tmp_path: Path) -> None:
    nvfp4 = RECIPES["nvfp4"]
    mismatched = ActivationBlocksOf32(**{f.name: getattr(nvfp4, f.name) for f in dataclasses.fields(nvfp4)})
    with pytest.raises(PipelineError, match="the reloaded checkpoint's logits differ from the calibrated model's"):
        run_tiny(llama_base, tmp_path / "out", recipe=mismatched)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_max_calibrated_awq_checkpoints_have_block_scales_that_fit_their_weights(
    llama_base: Path, tmp_path: Path, calibration_file: Path, static: bool
) -> None:
    # Without GPTQ, each block's scale is its largest weight's over 6 (rounded to FP8): that weight's
    # FP4 code is 6 (nibble 7) in every block. Scales fixed before AWQ rescaled the weights would
    # leave blocks that never reach it, or clip them.
    out = tmp_path / "out"
    result = run_tiny(llama_base, out, calibration_file=calibration_file,
                      recipe=variant("nvfp4", **AWQ, static_weight_scales=static))
    assert result.reload_max_logit_diff == 0.0
    tensors = stored(out)
    packed = [k for k in tensors if k.endswith(".weight") and tensors[k].dtype == torch.uint8]
    assert packed
    for name in packed:
        codes = tensors[name]
        magnitudes = torch.stack([codes & 0x7, (codes >> 4) & 0x7], dim=-1).reshape(codes.shape[0], -1, 16)
        assert bool((magnitudes.amax(dim=-1) == 7).all()), name
    # And one block of each fused group (q/k/v, gate/up, the others alone: those that share a
    # global scale) holds the group's largest weight: its FP8 block scale is E4M3's largest, 448.
    groups: dict[tuple[str, float], float] = {}
    for name in packed:
        prefix = name.rsplit(".", 2)[0]
        key = (prefix, float(tensors[name + "_scale_2"]))
        groups[key] = max(groups.get(key, 0.0), float(tensors[name + "_scale"].float().max()))
    assert set(groups.values()) == {448.0}, groups
