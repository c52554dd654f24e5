"""Tiny Glm4Moe and DeepseekV3 (the architectures GLM and Kimi ship): experts quantized per expert,
routers kept in BF16, every expert calibrated, and a refusal when one was not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline import PipelineError

from .helpers import run_tiny
from .test_run import tensors


@pytest.mark.parametrize(
    ("arch", "quantization"),
    [("glm4_moe", "nvfp4"), ("deepseek_v3", "nvfp4"), ("glm4_moe", "mxfp4"), ("deepseek_v3", "fp8")],
)
def test_moe_models_export_every_expert_with_its_scales(
    make_base, calibration_file: Path, tmp_path: Path, arch: str, quantization: str
) -> None:
    base = make_base(arch)
    out = tmp_path / "out"
    result = run_tiny(base, out, quantization, calibration_file=calibration_file)

    counts = result.expert_tokens["model.layers.1.mlp"]
    assert len(counts) == 4 and min(counts) > 0
    # top-2 routing: every calibration token is counted twice in the MoE layer
    assert sum(counts) == 2 * (result.corpus.user_tokens + result.corpus.general_tokens)
    t = tensors(out)
    packed = "weight_packed" if quantization == "mxfp4" else "weight"
    dtype = torch.float8_e4m3fn if quantization == "fp8" else torch.uint8
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            prefix = f"model.layers.1.mlp.experts.{e}.{proj}"
            assert t[f"{prefix}.{packed}"].dtype == dtype
            # What vLLM's routed-experts loaders create per expert projection (hidden 64, expert
            # intermediate 32): ModelOptNvFp4FusedMoE's packed E2M1 with E4M3 scales per 16, one
            # global and one input scale; CompressedTensorsW4A4Mxfp4MoEMethod's E8M0 scales per 32.
            rows, cols = (64, 32) if proj == "down_proj" else (32, 64)
            if quantization == "nvfp4":
                assert float(t[f"{prefix}.input_scale"]) > 0 and t[f"{prefix}.weight_scale_2"].numel() == 1
                assert t[f"{prefix}.weight"].shape == (rows, cols // 2)
                assert (t[f"{prefix}.weight_scale"].shape, t[f"{prefix}.weight_scale"].dtype) == ((rows, cols // 16), torch.float8_e4m3fn)
            elif quantization == "mxfp4":
                assert t[f"{prefix}.weight_packed"].shape == (rows, cols // 2)
                assert (t[f"{prefix}.weight_scale"].shape, t[f"{prefix}.weight_scale"].dtype) == ((rows, cols // 32), torch.uint8)
            else:
                assert t[f"{prefix}.weight"].shape == (rows, cols)
        if quantization == "nvfp4":
            gate, up = (
                float(t[f"model.layers.1.mlp.experts.{e}.{p}.weight_scale_2"])
                for p in ("gate_proj", "up_proj")
            )
            assert gate == up  # vLLM uses the gate's global scale for both
        if quantization == "fp8":
            # vLLM's ModelOpt FP8 MoE method reads one weight scale per expert projection (gate
            # and up requantized to their max) and a static input scale (the max over experts).
            scales = {
                (p, leaf): t[f"model.layers.1.mlp.experts.{e}.{p}.{leaf}"]
                for p in ("gate_proj", "up_proj", "down_proj")
                for leaf in ("weight_scale", "input_scale")
            }
            assert all(s.numel() == 1 and float(s) > 0 for s in scales.values())
            assert float(scales["gate_proj", "weight_scale"]) == float(scales["up_proj", "weight_scale"])
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.layers.1.mlp.gate.") and "scale" in k for k in t)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if quantization == "fp8":
        # Dense layers per channel with inputs per token, routed experts per tensor: what vLLM's
        # mixed-precision ModelOpt config reads layer by layer. The router is not listed.
        assert config["quant_algo"] == "MIXED_PRECISION"
        layers = config["quantized_layers"]
        assert layers["model.layers.1.mlp.experts"] == {"quant_algo": "FP8"}
        assert layers["model.layers.1.mlp.shared_experts.gate_proj"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
        assert layers["model.layers.1.self_attn.o_proj"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
        assert not any(name.startswith("model.layers.1.mlp.gate") for name in layers)
        assert t["model.layers.1.mlp.shared_experts.gate_proj.weight_scale"].numel() > 1
        assert "model.layers.1.mlp.shared_experts.gate_proj.input_scale" not in t
    else:
        excluded = config.get("ignore") or config.get("exclude_modules")
        assert "model.layers.1.mlp.gate" in excluded
    assert result.reload_max_logit_diff == 0.0


def test_it_refuses_to_export_an_expert_that_received_no_tokens(make_base, tmp_path: Path) -> None:
    base = make_base("glm4_moe")
    weights = load_file(str(base / "model.safetensors"))
    bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"].clone()
    bias[3] = -1e4  # the router can never pick expert 3
    weights["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        PipelineError, match=r"1 MoE experts received no calibration tokens \(model.layers.1.mlp.experts.3\)"
    ):
        run_tiny(base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_experts_gathered_in_chunks_give_the_same_checkpoint_as_all_at_once(
    make_base, calibration_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .model.test_streaming import checkpoint_bytes

    base = make_base("glm4_moe")
    whole = run_tiny(base, tmp_path / "whole", calibration_file=calibration_file)
    monkeypatch.setenv("FP4PREP_EXPERT_HESSIAN_MIB", "0")  # one expert's Hessians at a time
    chunked = run_tiny(base, tmp_path / "chunked", calibration_file=calibration_file)
    assert whole.expert_gptq == chunked.expert_gptq == {"model.layers.1.mlp.experts": [8, 0]}
    assert checkpoint_bytes(tmp_path / "chunked") == checkpoint_bytes(tmp_path / "whole")
