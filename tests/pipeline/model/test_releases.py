"""Bases that ship quantized (FP4 releases) read one tensor at a time, as the engine dequantizes
them: compressed-tensors NVFP4 and MXFP4, ModelOpt NVFP4, gpt-oss MXFP4 experts; a quantization the
reader does not know is refused before any work, naming what the base declares."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fp4prep.pipeline.errors import UserError
from fp4prep.pipeline.export import compressed_tensors
from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
from fp4prep.pipeline.model.releases import BaseSource, release_of
from fp4prep.pipeline.model.safetensors import TensorSource
from fp4prep.pipeline.validation import reader
from tests.tiny import save_adapter, save_expert_adapter

from ..bases import gpt_oss_release as gpt_oss_model
from ..helpers import run_tiny

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    """A tiny Llama as FP4 releases ship: MXFP4 and NVFP4 in compressed-tensors' layout, NVFP4 in
    ModelOpt's (fp4prep's own exports are those layouts; the BF16 base beside them)."""
    from tests.tiny import save_tiny_base

    root = tmp_path_factory.mktemp("releases")
    base = save_tiny_base(root / "bf16", "llama", tokenizer_dir)
    run_tiny(base, root / "ct-mxfp4", "mxfp4")
    run_tiny(base, root / "modelopt-nvfp4", "nvfp4")
    shutil.copytree(root / "modelopt-nvfp4", root / "ct-nvfp4")
    compressed_tensors.to_compressed_tensors(root / "ct-nvfp4", root / "ct-nvfp4")
    return {"bf16": base, **{name: root / name for name in ("ct-mxfp4", "modelopt-nvfp4", "ct-nvfp4")}}


@pytest.mark.parametrize("layout", ["ct-mxfp4", "modelopt-nvfp4", "ct-nvfp4"])
def test_an_fp4_release_reads_as_the_dense_model_the_engine_multiplies_by(releases: dict[str, Path], layout: str) -> None:
    release = releases[layout]
    source = BaseSource(release)
    dense = TensorSource(releases["bf16"])
    # The dense model's names and shapes: no packed bytes, block or global scales, input scales.
    assert sorted(source.names()) == sorted(dense.names())
    assert all(source.shape(n) == dense.shape(n) for n in dense.names())
    assert len(source.quantized) == 14 and source.release is not None
    # Bit for bit what the checkpoint reader computes (its arithmetic is tested against vLLM's).
    ours = reader.DequantizedWeights(release, torch.float32)
    for name in source.names():
        assert torch.equal(source.get(name, torch.float32), ours[name]), name
    quantized = sorted(source.quantized)[0]
    on_grid = source.get(quantized, torch.float32)
    original = dense.get(quantized, torch.float32)
    assert not torch.equal(on_grid, original) and torch.allclose(on_grid, original, atol=0.5 * original.abs().max())


def test_the_nvfp4_layouts_read_the_same_weights(releases: dict[str, Path]) -> None:
    modelopt, ct = BaseSource(releases["modelopt-nvfp4"]), BaseSource(releases["ct-nvfp4"])
    for name in modelopt.quantized:
        # compressed-tensors stores the reciprocal of the global scale: inverted back, one float32 step at most.
        assert torch.allclose(modelopt.get(name, torch.float32), ct.get(name, torch.float32), rtol=2**-22, atol=0), name


def test_compressed_tensors_own_decompression_reads_the_release_as_we_do(releases: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    for layout in ("ct-mxfp4", "ct-nvfp4"):
        theirs = AutoModelForCausalLM.from_pretrained(
            releases[layout], dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False)
        ).state_dict()
        source = BaseSource(releases[layout])
        for name in source.quantized:
            # compressed-tensors divides by the reciprocal global scale: at most one BF16 step apart.
            assert torch.allclose(source.get(name).float(), theirs[name].float(), rtol=2**-7, atol=0), (layout, name)


def gpt_oss_release(path: Path, experts: int = 4, hidden: int = 64, intermediate: int = 32) -> Path:
    """gpt-oss's MXFP4 layout: fused experts as ``*_blocks`` / ``*_scales``, attention kept BF16."""
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=generator).bfloat16(),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(experts, 2 * intermediate, generator=generator).bfloat16(),
    }
    for name, rows, columns in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
        blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
        tensors[f"model.layers.0.mlp.experts.{name}_blocks"] = blocks
        tensors[f"model.layers.0.mlp.experts.{name}_scales"] = torch.randint(120, 130, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "model_type": "gpt_oss", "num_hidden_layers": 1, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_local_experts": experts, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_gpt_oss_experts_read_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    release = gpt_oss_release(tmp_path / "gpt-oss")
    source = BaseSource(release)
    assert sorted(source.names()) == [
        "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.self_attn.q_proj.weight",
    ]
    for name, shape in (("gate_up_proj", (4, 64, 64)), ("down_proj", (4, 32, 64))):
        dense = f"model.layers.0.mlp.experts.{name}"
        expected = convert_moe_packed_tensors(source.raw(f"{dense}_blocks"), source.raw(f"{dense}_scales"), dtype=torch.float32)
        assert source.shape(dense) == shape == tuple(expected.shape)
        assert torch.equal(source.get(dense, torch.float32), expected)
    kept = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(source.get(kept), source.raw(kept))  # what the release kept BF16 reads as stored


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quantized as compressed-tensors' float-quantized"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "quantized as compressed-tensors' int-quantized"),
        ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quantized as ModelOpt's W4A8_AWQ"),
        ({"quant_method": "gptq", "bits": 4}, "quantized as gptq, which fp4prep does not read"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "quantized as fp8 with weight blocks [64, 64]"),
    ],
)
def test_a_base_quantized_in_a_way_the_reader_does_not_know_is_refused_naming_it(
    releases: dict[str, Path], tmp_path: Path, quantization_config: dict[str, Any], message: str
) -> None:
    base = tmp_path / "base"
    shutil.copytree(releases["bf16"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    message = re.escape(message)
    with pytest.raises(UserError, match=message):
        release_of(json.loads((base / "config.json").read_text()), str(base))
    # The job, before any work (no output, nothing calibrated); the upload's shape check too.
    with pytest.raises(UserError, match=message):
        run_tiny(base, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=message):
        base_weight_shapes(base)


def test_an_adapter_trained_on_an_fp4_release_merges_into_its_dense_weights(releases: dict[str, Path], tmp_path: Path) -> None:
    release = releases["ct-mxfp4"]
    # The adapter was trained on the release's weights: its shapes are the dense model's.
    adapter = save_adapter(releases["bf16"], tmp_path / "adapter", targets=TARGETS, b_scale=0.02)
    shapes = base_weight_shapes(release)
    assert shapes["tensors"]["model.layers.*.mlp.down_proj.weight"] == list(TensorSource(releases["bf16"]).shape("model.layers.0.mlp.down_proj.weight"))
    result = run_tiny(release, tmp_path / "out", "mxfp4", adapter_dir=adapter, quality_gate=False)
    assert result.retention is not None and len(result.retention.per_tensor) == 14
    # Every read of the release is counted, in its own (FP4) bytes.
    base_reads = result.reads["base"]
    assert base_reads["size_bytes"] == sum(p.stat().st_size for p in release.glob("*.safetensors"))
    assert base_reads["total_passes"] > 0


def stored(directory: Path) -> dict[str, bytes]:
    source = TensorSource(directory)
    return {name: source.raw(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for name in source.names()}


@pytest.mark.parametrize("layout", ["ct-mxfp4", "ct-nvfp4", "modelopt-nvfp4"])
def test_a_model_prepared_from_a_release_keeps_its_format_and_every_tensor_the_adapter_leaves_alone(
    releases: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    release = releases[layout]
    adapter = save_adapter(releases["bf16"], tmp_path / "adapter", targets=["q_proj"], b_scale=0.05)
    quantization = "mxfp4" if "mxfp4" in layout else "nvfp4"
    result = run_tiny(release, tmp_path / "out", quantization, adapter_dir=adapter, quality_gate=False)
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["quantization_config"] == json.loads((release / "config.json").read_text())["quantization_config"]
    ours, theirs = stored(out), stored(release)
    assert sorted(ours) == sorted(theirs)
    differ = sorted(name for name in theirs if ours[name] != theirs[name])
    packed = "weight" if layout == "modelopt-nvfp4" else "weight_packed"
    layers = {n.split(".")[2] for n in theirs if n.startswith("model.layers.")}
    # Only the changed projections' codes: their block and global scales, and everything else, as shipped.
    assert differ == sorted(f"model.layers.{i}.self_attn.q_proj.{packed}" for i in layers)
    assert result.release is not None
    counts = {k: result.release[k] for k in ("copied", "requantized", "rewritten")}
    assert counts == {"copied": len(theirs) - len(layers), "requantized": len(layers), "rewritten": 0}
    assert result.release["rounding"].startswith("by GPTQ on the release's block scales in activation order, then coordinate descent")
    assert result.release["rounded_to_nearest"] == {}
    assert any("read back bit for bit as written" in check for check in result.checks)
    card = (out / "README.md").read_text()
    assert f"{len(theirs) - len(layers)} tensors copied from the release" in card


def test_a_layer_is_rounded_stage_by_stage_in_the_order_it_reads_its_inputs_and_its_weights_put_back(
    releases: dict[str, Path], tmp_path: Path
) -> None:
    from fp4prep.pipeline import device
    from fp4prep.pipeline.algorithms import held_gptq, held_inputs
    from fp4prep.pipeline.model import layer_walk, streaming
    from fp4prep.pipeline.model.merge import MergedWeights, load_adapter
    from fp4prep.pipeline.model.safetensors import read_config

    release = releases["ct-mxfp4"]
    source = BaseSource(release)
    compute = device.resolve("cpu")
    adapter = load_adapter(save_adapter(releases["bf16"], tmp_path / "adapter", targets=TARGETS))
    merged = MergedWeights(source, adapter, compute.dtype, compute.device)
    model = streaming.build(read_config(release), merged, compute, release)
    by_layer, skipped = held_gptq.targets(source, merged, model)
    assert skipped == {}
    ids = torch.randint(0, 100, (2, 24))
    walk = layer_walk.Walk(model, [(ids, torch.ones_like(ids))])
    layer = walk.layers[0]
    with layer_walk.held(list(layer.modules())):
        stages = held_inputs.stages(model, layer, list(reversed(by_layer[0])), walk.hidden[0], walk.calls[0][0])
        assert [sorted(t.module.rsplit(".", 1)[1] for t in stage) for stage in stages] == [
            ["k_proj", "q_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]
        ]
        before = layer_walk.run_layer(layer, walk.hidden[0], walk.calls[0][0])
        q = stages[0][0]
        zero = torch.zeros(model.get_submodule(q.module).weight.shape)
        with held_inputs.rounded_in([held_inputs.placed(model, merged, merged.names.stored_of(), q, zero)]):
            assert not model.get_submodule(q.module).weight.any()
            assert not torch.equal(layer_walk.run_layer(layer, walk.hidden[0], walk.calls[0][0]), before)
        assert torch.equal(layer_walk.run_layer(layer, walk.hidden[0], walk.calls[0][0]), before)


def test_a_release_is_prepared_in_its_own_format_only(releases: dict[str, Path], tmp_path: Path) -> None:
    adapter = save_adapter(releases["bf16"], tmp_path / "adapter", targets=["q_proj"])
    with pytest.raises(UserError, match=r"the base is MXFP4 release \(compressed-tensors\): a model prepared from it keeps the release's format, so ask for mxfp4, not nvfp4"):
        run_tiny(releases["ct-mxfp4"], tmp_path / "out", "nvfp4", adapter_dir=adapter)
    assert not (tmp_path / "out").exists()


def test_on_a_moe_release_attention_changes_leave_every_expert_byte_and_expert_changes_only_expert_codes(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    from tests.tiny import save_expert_adapter, save_tiny_base

    base = save_tiny_base(tmp_path / "bf16", "glm4_moe", tokenizer_dir)
    release = tmp_path / "release"
    run_tiny(base, release, "mxfp4")
    theirs = stored(release)
    experts = {n for n in theirs if ".mlp.experts." in n}
    assert experts

    attention = save_adapter(base, tmp_path / "attention", targets=["q_proj", "o_proj"], b_scale=0.05)
    run_tiny(release, tmp_path / "out-attention", "mxfp4", adapter_dir=attention, quality_gate=False)
    ours = stored(tmp_path / "out-attention")
    differ = {n for n in theirs if ours[n] != theirs[n]}
    assert differ and all(n.endswith(("q_proj.weight_packed", "o_proj.weight_packed")) for n in differ)
    assert not differ & experts

    on_experts = save_expert_adapter(base, tmp_path / "experts")
    result = run_tiny(release, tmp_path / "out-experts", "mxfp4", adapter_dir=on_experts, quality_gate=False)
    assert result.release is not None
    # Each routed expert's weights rounded by GPTQ on the Hessian of the tokens routed to it, or, with
    # fewer such tokens than its input width, to nearest.
    gptq_rounded = result.release["requantized"] - len(result.release["rounded_to_nearest"])
    assert gptq_rounded > 0, result.release
    ours = stored(tmp_path / "out-experts")
    differ = {n for n in theirs if ours[n] != theirs[n]}
    assert differ & experts  # the experts it changed, by their codes only
    assert all(n.endswith("weight_packed") and (n in experts or n.endswith("q_proj.weight_packed")) for n in differ)


def test_gptq_on_the_release_scales_keeps_more_of_a_small_change_than_rounding_to_nearest(
    releases: dict[str, Path], tmp_path: Path
) -> None:
    """A change mostly under half an FP4 step, as an adapter trained on the release learns: rounded to
    nearest on the release's scales most of it snaps back; GPTQ carries it into the outputs."""
    import dataclasses

    from fp4prep.pipeline.recipes import recipe_for

    adapter = save_adapter(releases["bf16"], tmp_path / "adapter", targets=TARGETS, b_scale=0.004)
    gptq = run_tiny(releases["ct-mxfp4"], tmp_path / "gptq", "mxfp4", adapter_dir=adapter, quality_gate=False)
    nearest = run_tiny(
        releases["ct-mxfp4"], tmp_path / "nearest", "mxfp4", adapter_dir=adapter, quality_gate=False,
        recipe=dataclasses.replace(recipe_for("mxfp4"), steps=()),
    )
    assert gptq.release is not None and nearest.release is not None
    assert nearest.release["rounding"] == "to nearest on the release's block scales"
    kept, kept_nearest = gptq.release["kept_in_outputs"], gptq.release["kept_in_outputs_nearest"]
    assert kept_nearest < 0.5 and kept > kept_nearest + 0.1, gptq.release
    assert gptq.retention is not None and nearest.retention is not None
    assert gptq.parity.answer_kl <= nearest.parity.answer_kl


def test_a_gpt_oss_release_is_prepared_in_its_own_layout(tmp_path: Path, tokenizer_dir: Path) -> None:
    release, dense = gpt_oss_model(tmp_path / "gpt-oss", tokenizer_dir)
    theirs = stored(release)
    # Attention only: every expert byte as shipped; the merged projections written in BF16, as the release keeps them.
    attention = save_adapter(dense, tmp_path / "attention", targets=["q_proj", "v_proj"], b_scale=0.05)
    result = run_tiny(release, tmp_path / "out", "mxfp4", adapter_dir=attention, quality_gate=False)
    ours = stored(tmp_path / "out")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[n] == theirs[n] for n in theirs if ".experts." in n)
    assert sorted(n for n in theirs if ours[n] != theirs[n]) == [
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in ("q", "v")
    ]
    assert result.parity.answer_kl < 1e-6  # nothing it changed is quantized: the merged model itself
    # Routed experts too: their codes re-written on the release's scales, read back exactly.
    experts = save_expert_adapter(dense, tmp_path / "experts")
    result = run_tiny(release, tmp_path / "experts-out", "mxfp4", adapter_dir=experts, quality_gate=False)
    ours = stored(tmp_path / "experts-out")
    changed = sorted(n for n in theirs if ours[n] != theirs[n])
    assert changed == sorted(
        [f"model.layers.{i}.mlp.experts.{p}_blocks" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]
        + [f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1)]
    )
    # Each expert rounded by GPTQ on its own routed tokens (its gated inputs for down_proj), then descent.
    assert result.release is not None and result.release["rounded_to_nearest"] == {}
    assert result.release["kept_in_outputs"] > result.release["kept_in_outputs_nearest"]
    assert any("read back bit for bit as written" in check for check in result.checks)
    assert result.retention is not None and result.retention.pooled > 0.5
