"""Recipes beyond max calibration, on tiny models: AWQ folded away, GPTQ, a recipe checked when built, and
the reload check that catches a calibrated model the engine would not reproduce."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fp4prep.pipeline import PipelineError
from fp4prep.pipeline.formats import FORMATS
from fp4prep.pipeline.recipes import RECIPES, AwqSearch, Gptq, Recipe
from tests.tiny import save_adapter

from .helpers import run_tiny

AWQ = (AwqSearch(alpha_step=0.25),)
# AWQ, then GPTQ on the folded weights (against static weight scales for NVFP4).
AWQ_GPTQ = (AwqSearch(alpha_step=0.25), Gptq(hessian_stride=1))
# The same with NVFP4's block scales searched on each block's outputs (the quantizers' amax moved).
AWQ_GPTQ_SEARCH = (AwqSearch(alpha_step=0.25), Gptq(hessian_stride=1, nv_scales="search"))


def variant(fmt: str, steps: tuple[Any, ...]) -> Recipe:
    return Recipe(FORMATS[fmt], RECIPES[fmt].thresholds, steps=steps)


def stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.parametrize(
    ("arch", "fmt", "steps"),
    [
        ("llama", "nvfp4", AWQ),
        ("glm4_moe", "nvfp4", AWQ),
        ("llama", "mxfp4", AWQ),
        ("llama", "nvfp4", AWQ_GPTQ),
        ("glm4_moe", "nvfp4", AWQ_GPTQ),
        ("llama", "mxfp4", AWQ_GPTQ),  # MXFP4's scales are the blocks' own
        ("llama", "nvfp4", AWQ_GPTQ_SEARCH),
        ("glm4_moe", "nvfp4", AWQ_GPTQ_SEARCH),  # routed experts' scales searched too
    ],
    ids=["llama-nvfp4", "glm4_moe-nvfp4", "llama-mxfp4", "llama-nvfp4-gptq", "glm4_moe-nvfp4-gptq", "llama-mxfp4-gptq",
         "llama-nvfp4-gptq-search", "glm4_moe-nvfp4-gptq-search"],
)
def test_awq_scales_are_folded_away_and_the_checkpoint_is_the_plain_format(
    make_base: Any, tmp_path: Path, calibration_file: Path, arch: str, fmt: str, steps: tuple[Any, ...]
) -> None:
    base = make_base(arch)
    targets = ["q_proj", "v_proj", "o_proj"] + (["gate_proj", "up_proj", "down_proj"] if arch == "llama" else [])
    adapter = save_adapter(base, tmp_path / "adapter", targets=targets, b_scale=0.05)
    out = tmp_path / "out"
    result = run_tiny(base, out, fmt, adapter_dir=adapter, calibration_file=calibration_file, recipe=variant(fmt, steps))
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


@pytest.mark.parametrize("steps", [AWQ, AWQ_GPTQ], ids=["awq", "awq-gptq"])
def test_an_awq_run_stopped_midway_resumes_to_the_same_bytes(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, steps: tuple[Any, ...]
) -> None:
    from transformers import AutoModelForCausalLM

    from fp4prep.pipeline import Cancelled
    from tests.tiny import tiny_config

    from .model.test_streaming import cancel_at, checkpoint_bytes

    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    for f in tokenizer_dir.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "down_proj"], b_scale=0.05)
    common = {"adapter_dir": adapter, "calibration_file": calibration_file, "recipe": variant("nvfp4", steps)}
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


def test_a_calibrated_model_the_engine_would_not_reproduce_fails_the_reload_check(
    llama_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fp4prep.pipeline.modelopt_ext import quantizers

    config_of = quantizers.quant_config

    def activation_blocks_of_32(*args: Any, **kwargs: Any) -> dict[str, Any]:
        # NVFP4 with activations calibrated in blocks of 32: engines quantize them in blocks of 16.
        config = config_of(*args, **kwargs)
        for entry in config["quant_cfg"]:
            if entry.get("quantizer_name") == "*input_quantizer" and isinstance(entry.get("cfg"), dict):
                entry["cfg"]["block_sizes"] = {**entry["cfg"]["block_sizes"], -1: 32}
        return config

    monkeypatch.setattr(quantizers, "quant_config", activation_blocks_of_32)
    with pytest.raises(PipelineError, match="the reloaded checkpoint's logits differ from the calibrated model's"):
        run_tiny(llama_base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_max_calibrated_awq_checkpoints_have_block_scales_that_fit_their_weights(
    llama_base: Path, tmp_path: Path, calibration_file: Path
) -> None:
    # Without GPTQ, each block's scale is its largest weight's over 6 (rounded to FP8): that weight's
    # FP4 code is 6 (nibble 7) in every block, folded weights included.
    out = tmp_path / "out"
    result = run_tiny(llama_base, out, calibration_file=calibration_file, recipe=variant("nvfp4", AWQ))
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


@pytest.mark.parametrize(
    ("fmt", "steps", "message"),
    [
        ("fp8", (Gptq(),), "fp8 is max-calibrated: its recipe takes no steps"),
        ("nvfp4", (Gptq(), AwqSearch()), "runs AwqSearch, then Gptq, each at most once"),
        ("nvfp4", (Gptq(), Gptq()), "runs AwqSearch, then Gptq, each at most once"),
        ("nvfp4", (AwqSearch(alpha_step=0),), r"alpha_step must be in \(0, 1\]"),
        ("mxfp4", (Gptq(hessian_stride=0),), "hessian_stride must be at least 1"),
        ("nvfp4", ("gptq",), "a recipe's steps are AwqSearch and Gptq"),
        ("nvfp4", (Gptq(mx_exponents="nearest"),), "nvfp4 has no power-of-two block scales to choose"),
        ("mxfp4", (Gptq(mx_exponents="round"),), "Gptq.mx_exponents is 'ceil', 'nearest' or 'best', not 'round'"),
        ("mxfp4", (Gptq(nv_scales="search"),), "mxfp4 has no E4M3 block scales to search"),
        ("nvfp4", (Gptq(nv_scales="clip"),), "Gptq.nv_scales is 'max' or 'search', not 'clip'"),
    ],
)
def test_a_recipe_that_cannot_run_is_refused_when_it_is_built(fmt: str, steps: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        variant(fmt, steps)


def test_the_shipped_recipes_say_what_they_run() -> None:
    assert RECIPES["nvfp4"].static_weight_scales and RECIPES["nvfp4"].mutates_weights
    assert not RECIPES["mxfp4"].static_weight_scales and RECIPES["mxfp4"].gptq is not None and RECIPES["mxfp4"].awq is None
    assert not RECIPES["fp8"].mutates_weights
    assert RECIPES["nvfp4"].calibration == (
        "AWQ search (alpha step 0.5), scales folded into the preceding norms and projections, "
        "then GPTQ against static weight scales in activation order"
    )
    assert RECIPES["mxfp4"].calibration == "max, then GPTQ against each block's own scale in activation order"


def test_an_mxfp4_recipe_calibrated_for_blackwells_inputs_still_declares_weights_only(
    make_base: Any, tmp_path: Path, calibration_file: Path
) -> None:
    """Calibrated with MXFP4 inputs (as vLLM runs them on Blackwell), the checkpoint is the plain
    weights-only MXFP4 one, and the calibrated model it is checked against computes that."""
    import dataclasses

    from fp4prep.pipeline.serving import MXFP4_W4A4

    base = make_base("llama")
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "v_proj", "o_proj"], b_scale=0.05)
    plain = variant("mxfp4", AWQ_GPTQ)
    results = {}
    for name, recipe in (("plain", plain), ("blackwell", dataclasses.replace(plain, calibrate_for=MXFP4_W4A4.key))):
        results[name] = run_tiny(base, tmp_path / name, "mxfp4", adapter_dir=adapter, calibration_file=calibration_file, recipe=recipe)
    config = json.loads((tmp_path / "blackwell" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"] is None
    assert results["blackwell"].reload_max_logit_diff == 0.0
    lineage = json.loads((tmp_path / "blackwell" / "fp4prep.json").read_text())
    assert lineage["recipe"]["calibration"].endswith("with the inputs quantized to MXFP4 as vLLM does on Blackwell")
    # The AWQ search scored its candidates on the quantized inputs: it chose other scales.
    assert stored(tmp_path / "plain").keys() == stored(tmp_path / "blackwell").keys()
    assert any(not torch.equal(a, stored(tmp_path / "blackwell")[k]) for k, a in stored(tmp_path / "plain").items())


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_only_mxfp4_is_calibrated_for_another_hardwares_inputs(fmt: str) -> None:
    import dataclasses

    with pytest.raises(ValueError, match="can't be calibrated for 'mxfp4-w4a4'"):
        dataclasses.replace(RECIPES[fmt], calibrate_for="mxfp4-w4a4")
    with pytest.raises(ValueError, match="can't be calibrated for 'fp16'"):
        dataclasses.replace(RECIPES["mxfp4"], calibrate_for="fp16")


def test_mxfp4_served_on_blackwell_is_calibrated_for_its_inputs() -> None:
    from fp4prep.pipeline.recipes import MXFP4_FOR_BLACKWELL, recipe_for

    assert recipe_for("mxfp4", ["NVIDIA B200", "NVIDIA GB200"]) is MXFP4_FOR_BLACKWELL
    # Served on Hopper too, which runs it weights-only as declared: the format's own recipe.
    assert recipe_for("mxfp4", ["NVIDIA H200", "NVIDIA B200"]) is RECIPES["mxfp4"]
    assert recipe_for("mxfp4", ["NVIDIA H200"]) is RECIPES["mxfp4"] and recipe_for("MXFP4") is RECIPES["mxfp4"]
    assert recipe_for("nvfp4", ["NVIDIA B200"]) is RECIPES["nvfp4"]
    assert MXFP4_FOR_BLACKWELL.format is RECIPES["mxfp4"].format  # the checkpoint is the same format


def test_a_run_for_other_hardware_does_not_resume_another_recipes_calibration(tmp_path: Path) -> None:
    from fp4prep.pipeline import PipelineConfig, device
    from fp4prep.pipeline.workdir import fingerprint

    compute = device.resolve("cpu")

    def of(*hardware: str, quantization: str = "mxfp4") -> dict[str, Any]:
        config = PipelineConfig(base_dir=tmp_path, output_dir=tmp_path / "out", quantization=quantization, serving_hardware=list(hardware))
        return fingerprint(config, compute, None)

    assert of("NVIDIA H200") == of() == of("NVIDIA B200", "NVIDIA H100") != of("NVIDIA B200") == of("NVIDIA GB200")
    assert of("NVIDIA B200", quantization="nvfp4") == of(quantization="nvfp4")
