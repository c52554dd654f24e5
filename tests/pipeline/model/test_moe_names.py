"""Mixture-of-experts checkpoints as their authors store them, read as transformers reads them, and
LoRA adapters on their experts merged as PEFT merges them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline import UserError
from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes, check_against_base
from fp4prep.pipeline.model import merge
from fp4prep.pipeline.model.safetensors import TensorSource
from tests.tiny import per_expert_modules, save_expert_adapter

from ..helpers import TINY, run_tiny
from ..test_run import tensors

FAMILIES = ["mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3"]


def transformers_state(base: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).state_dict()


def read_as_we_do(base: Path, adapter: Path | None = None) -> merge.MergedWeights:
    return merge.MergedWeights(TensorSource(base), merge.load_adapter(adapter) if adapter else None, torch.float32)


def bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, in units of BF16's spacing at the expected value."""
    spacing = torch.finfo(torch.bfloat16).eps * expected.float().abs().clamp(min=2**-126)
    return float(((got.float() - expected.float()).abs() / spacing).max())


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_tensor_reads_as_from_pretrained_loads_it(make_base, arch: str) -> None:
    base = make_base(arch)  # saved by save_pretrained: the hub's per-expert names (Mixtral: w1/w2/w3)
    stored = list(load_file(str(base / "model.safetensors")))
    assert any(".experts.3." in name for name in stored)
    reference = transformers_state(base)
    weights = read_as_we_do(base)
    assert set(weights) == set(reference)
    fused = [name for name in reference if reference[name].dim() == 3]
    assert fused, "the model holds its experts fused"
    for name in weights:  # (a router transformers keeps in FP32 is read as the BF16 model's)
        assert torch.equal(weights[name].to(torch.bfloat16), reference[name].to(torch.bfloat16)), name


def test_a_checkpoint_stored_with_the_models_own_fused_names_reads_alike(make_base, tmp_path: Path) -> None:
    base = make_base("qwen3_moe")
    reference = transformers_state(base)
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in reference.items()}, str(fused / "model.safetensors"), metadata={"format": "pt"})
    weights = read_as_we_do(fused)
    assert weights.names.fused == {}  # nothing to assemble: stored as the model holds it
    for name in weights:
        assert torch.equal(weights[name].to(torch.bfloat16), reference[name]), name


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_lora_on_fused_expert_tensors_merges_as_peft_merges_it(make_base, tmp_path: Path, arch: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_base(arch)
    adapter = save_expert_adapter(base, tmp_path / "adapter")
    keys = list(load_file(str(adapter / "adapter_model.safetensors")))
    assert any(k.endswith("mlp.experts.base_layer.lora_A.weight") for k in keys)  # PEFT nests one per tensor
    ours = read_as_we_do(base, adapter)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    reference = peft.merge_and_unload().state_dict()
    original = transformers_state(base)
    changed = []
    for name in ours:
        got = ours[name]
        # Both add in fp32; ours rounds once to BF16, PEFT's stays fp32: within one BF16 step.
        assert bf16_ulps(got, reference[name]) <= 1.0, name
        if not torch.equal(got.to(torch.bfloat16), original[name]):
            changed.append(name)
    moe_layers = [1] if arch == "qwen3_moe" else [0, 1]
    expected = {f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1)}
    expected |= {f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in ("gate_up_proj", "down_proj")}
    assert set(changed) == expected
    for name in expected - {n for n in expected if "q_proj" in n}:
        for e in range(4):  # every expert's weights moved
            assert not torch.equal(ours[name][e].to(torch.bfloat16), original[name][e])
    # The checkpoint stores experts apart: the change is merged per expert and stored tensor.
    assert all(".experts." in t and t.endswith(".weight") for t in ours.targets() if "q_proj" not in t)


def test_lora_on_per_expert_linear_modules_merges_as_peft_merges_it(make_base, tmp_path: Path) -> None:
    """An adapter trained where each expert is a Linear module (transformers 4's Mixtral): its
    targets are the checkpoint's own names, block_sparse_moe.experts.N.w1 and so on."""
    from peft import LoraConfig, get_peft_model

    base = make_base("mixtral")
    state = load_file(str(base / "model.safetensors"))
    torch.manual_seed(3)
    model = get_peft_model(
        per_expert_modules(state), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["w1", "w2", "w3"])
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "adapter")
    reference = model.merge_and_unload().state_dict()
    ours = read_as_we_do(base, tmp_path / "adapter")
    targets = ours.targets()
    assert len(targets) == 2 * 4 * 3  # two MoE layers, four experts, three projections
    for name in targets:
        assert bf16_ulps(ours.merged(name), reference[name]) <= 1.0, name
        assert not torch.equal(ours.merged(name), state[name])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        # Saved from a base with 8 experts: A and B hold twice the matrices, rank 8 per expert here.
        ("experts", r"model.layers.1.mlp.experts.down_proj: its LoRA matrices have rank 8, but adapter_config.json gives it r=4"),
        # Saved from a base with a narrower expert: A's inputs fit neither fused tensor.
        ("width", r"model.layers.1.mlp.experts: its LoRA matrices \(16, 16\) and \(64, 16\) fit none of the base's"),
    ],
)
def test_an_expert_adapter_is_checked_at_upload_as_the_merge_checks_it(
    make_base, tmp_path: Path, damage: str, message: str
) -> None:
    base = make_base("mixtral")
    adapter = save_expert_adapter(base, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    table = base_weight_shapes(base)
    assert "model.layers.*.mlp.experts.gate_up_proj" in table["tensors"]
    assert "model.layers.*.block_sparse_moe.experts.*.w1.weight" in table["tensors"]
    check_against_base(shapes, config, table)  # accepted as saved

    a, b = (f"base_model.model.model.layers.1.mlp.experts.lora_{k}.weight" for k in "AB")  # down_proj's
    if damage == "experts":
        tensors[a], tensors[b] = torch.cat([tensors[a], tensors[a]]), torch.cat([tensors[b], tensors[b]], dim=1)
    else:
        tensors[a] = tensors[a][:, :16].contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(UserError, match=message):
        check_against_base({k: tuple(v.shape) for k, v in tensors.items()}, config, table)
    with pytest.raises(UserError, match=message):
        read_as_we_do(base, adapter)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("model.layers.1.block_sparse_moe.experts.9999.w1", "experts.9999.w1, but the base has 4 routed experts a layer"),
        (f"model.layers.1.block_sparse_moe.experts.{'9' * 5000}.w1", "but the base has 4 routed experts a layer"),
        (f"model.layers.{'7' * 5000}.block_sparse_moe.experts.0.w1", "but the base has 2 layers"),
    ],
    ids=["expert-9999", "expert-5000-digits", "layer-5000-digits"],
)
def test_a_per_expert_module_past_the_bases_experts_or_layers_is_refused_at_upload(
    make_base, module: str, message: str
) -> None:
    table = base_weight_shapes(make_base("mixtral"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1"]}
    shapes = {f"base_model.model.{module}.lora_A.weight": (4, 64), f"base_model.model.{module}.lora_B.weight": (32, 4)}
    good = {k.replace(module, "model.layers.1.block_sparse_moe.experts.3.w1"): v for k, v in shapes.items()}
    check_against_base(good, config, table)  # the last expert of the last layer: accepted
    with pytest.raises(UserError, match=message):
        check_against_base(shapes, config, table)


def test_a_mixtral_checkpoint_goes_through_with_its_expert_adapter_and_keeps_its_names(
    make_base, calibration_file: Path, tmp_path: Path
) -> None:
    base = make_base("mixtral")
    adapter = save_expert_adapter(base, tmp_path / "adapter")
    out = tmp_path / "out"
    result = run_tiny(base, out, "nvfp4", calibration_file=calibration_file, adapter_dir=adapter, thresholds=TINY)
    t = tensors(out)
    for e in range(4):
        for proj in ("w1", "w2", "w3"):  # vLLM's Mixtral loader reads the hub's names
            assert t[f"model.layers.1.block_sparse_moe.experts.{e}.{proj}.weight"].dtype == torch.uint8
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.block_sparse_moe.gate" in config["ignore"]
    assert result.reload_max_logit_diff == 0.0
    assert result.retention is not None and result.retention.pooled > 0.9
    assert any(".block_sparse_moe.experts.3.w3.weight" in name for name in result.retention.per_tensor)


def test_retention_undoes_each_routed_experts_fold_on_the_tensors_mixtral_stores_per_expert(
    make_base, calibration_file: Path, tmp_path: Path
) -> None:
    """With the AWQ search on routed experts, ``w2`` (down) is stored times its expert's scale per
    column and ``w3`` (up) divided by it per row: retention must undo that, expert by expert, or the
    change it measures is the fold's, not the adapter's."""
    import dataclasses

    from fp4prep.pipeline.recipes import RECIPES, AwqSearch

    base = make_base("mixtral")
    weights_file = next(base.glob("*.safetensors"))
    weights = load_file(weights_file)
    for name in weights:  # outlier channels in every expert's down input, so the search scales them
        if name.endswith(".w3.weight"):
            weights[name][:3] *= 30
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    # A change well above FP4's rounding of these outlier rows (b_std 0.02 left one tensor at 0.76 with
    # FP32 compute, from rounding alone), so the measure reads the fold, not quantization noise.
    adapter = save_expert_adapter(base, tmp_path / "adapter", b_std=0.05)
    recipe = RECIPES["nvfp4"]
    searched = dataclasses.replace(recipe, steps=(AwqSearch(routed_experts=True), *recipe.steps[1:]))
    result = run_tiny(base, tmp_path / "out", "nvfp4", calibration_file=calibration_file, adapter_dir=adapter,
                      thresholds=TINY, recipe=searched)
    assert result.retention is not None and result.reload_max_logit_diff == 0.0
    experts = {n: r for n, r in result.retention.per_tensor.items() if ".experts." in n}
    assert {n.rsplit(".", 2)[-2] for n in experts} == {"w1", "w2", "w3"}
    assert all(0.8 < r < 1.2 for r in experts.values()), experts
    # The same tensors measured without undoing the fold read far off: the band above tells the two apart.
    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.model.merge import MergedWeights, load_adapter
    from fp4prep.pipeline.model.releases import BaseSource
    from fp4prep.pipeline.validation.reader import DequantizedWeights
    from fp4prep.pipeline.validation.retention import Retention

    compute = resolve("cpu")
    merged = MergedWeights(BaseSource(base), load_adapter(adapter), compute.dtype, compute.device)
    report = Retention(merged, DequantizedWeights(tmp_path / "out", compute.dtype, compute.device)).report()
    assert report is not None
    folded = [r for n, r in report.per_tensor.items() if ".experts." in n and not 0.8 < r < 1.2]
    assert folded, report.per_tensor
