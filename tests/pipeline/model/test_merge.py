"""Merging a LoRA adapter into BF16 weights, and every refusal."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline import UserError
from fp4prep.pipeline.model import merge
from fp4prep.pipeline.model.safetensors import TensorSource
from tests.tiny import save_adapter, save_tiny_base

TARGETS = ["q_proj", "v_proj", "down_proj"]


def merged_state(base: Path, adapter: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The whole base with the adapter merged as the pipeline merges each tensor, and what changed."""
    state = dict(TensorSource(base).items())
    loaded = merge.load_adapter(adapter)
    updates, replacements = merge.plan(loaded, TensorSource(base))
    for update in updates:
        state[update.target] = update.apply(state[update.target])
    for name, stored in replacements.items():
        state[name] = loaded.read(stored).to(state[name].dtype)
    return state, sorted({u.target for u in updates} | set(replacements))


def reference_merge(base: Path, adapter: Path, name: str) -> torch.Tensor:
    """W + scaling * B @ A in float64, straight from the files."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    module = name.removesuffix(".weight")
    a = tensors[f"base_model.model.{module}.lora_A.weight"].double()
    b = tensors[f"base_model.model.{module}.lora_B.weight"].double()
    r = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    return TensorSource(base).get(name, torch.float64) + scaling * (b @ a)


@pytest.mark.parametrize("rslora", [False, True])
def test_it_merges_in_fp32_and_matches_an_independent_float64_merge(
    llama_base: Path, tmp_path: Path, rslora: bool
) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, use_rslora=rslora)
    state, changed = merged_state(llama_base, adapter)
    assert len(changed) == 2 * 3  # two layers, three targets
    for name in changed:
        expected = reference_merge(llama_base, adapter, name)
        got = state[name]
        assert got.dtype == torch.bfloat16
        # Within half a BF16 step of the exact result: computed in fp32, rounded once.
        ulp = torch.finfo(torch.bfloat16).eps * expected.abs().clamp(min=2**-126)
        assert torch.all((got.double() - expected).abs() <= ulp * 0.5 + 1e-12)


def test_it_agrees_with_peft_merge_and_unload(llama_base: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    state, changed = merged_state(llama_base, adapter)
    model = AutoModelForCausalLM.from_pretrained(llama_base, dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    for name in changed:
        assert torch.allclose(
            state[name].float(), peft_merged[name].to(torch.bfloat16).float(), atol=1e-2, rtol=0
        )
        assert float((state[name].float() - peft_merged[name]).abs().max()) < 4e-3


def test_it_changes_every_targeted_module_and_nothing_else(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    base = dict(TensorSource(llama_base).items())
    state, changed = merged_state(llama_base, adapter)
    for name, tensor in state.items():
        differs = not torch.equal(tensor, base[name])
        assert differs == (name in changed), name
    assert all(any(f".{t}." in n for t in TARGETS) for n in changed)


def test_it_refuses_a_directory_without_adapter_config(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(UserError, match="adapter_config.json is missing"):
        merge.load_adapter(adapter)


def test_it_refuses_an_adapter_without_weights(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(UserError, match="adapter_model.safetensors is missing"):
        merge.load_adapter(adapter)


def test_it_refuses_an_adapter_trained_on_another_architecture(
    llama_base: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    deepseek = save_tiny_base(tmp_path / "deepseek", "deepseek_v3", tokenizer_dir)
    adapter = save_adapter(deepseek, tmp_path / "adapter", targets=["q_a_proj", "kv_a_proj_with_mqa"])
    with pytest.raises(UserError, match="targets modules the base model does not have: .*q_a_proj"):
        merged_state(llama_base, adapter)


def test_it_refuses_an_adapter_whose_shapes_do_not_match(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.randn(tensors[key].shape[0], 96)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(UserError, match=r"model.layers.0.self_attn.q_proj: it makes a 64x96 change.*64x64"):
        merged_state(llama_base, adapter)


def test_it_refuses_target_modules_the_base_does_not_have(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    renamed = {k.replace("self_attn.q_proj", "self_attn.query_key_value"): v for k, v in tensors.items()}
    save_file(renamed, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(UserError, match="targets modules the base model does not have: .*query_key_value"):
        merged_state(llama_base, adapter)


def test_it_refuses_an_adapter_whose_lora_b_is_all_zero(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, b_scale=0.0)
    with pytest.raises(UserError, match="every LoRA-B matrix in the adapter is zero"):
        merged_state(llama_base, adapter)


def test_it_refuses_an_adapter_that_is_not_lora(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["peft_type"] = "IA3"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="does not describe a LoRA adapter \\(peft_type 'IA3'\\)"):
        merge.load_adapter(adapter)


def test_a_missing_adapter_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        merge.load_adapter(tmp_path / "nowhere")


def test_it_honours_alpha_pattern_per_module(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"v_proj": 32}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    plan, _ = merge.plan(merge.load_adapter(adapter), TensorSource(llama_base))
    scaling = {u.target.split(".")[-2]: u.scaling for u in plan}
    assert scaling == {"q_proj": 8 / 4, "v_proj": 32 / 4, "down_proj": 8 / 4}


def test_a_copied_base_is_untouched_on_disk(llama_base: Path, tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in llama_base.glob("*.safetensors")}
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    merged_state(llama_base, adapter)
    assert before == {p.name: p.read_bytes() for p in llama_base.glob("*.safetensors")}
    shutil.rmtree(adapter)


def test_a_rank_pattern_that_is_not_a_regular_expression_is_a_user_error(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {"v_proj(": 8}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"rank_pattern key 'v_proj\(' is not a valid regular expression"):
        merge.load_adapter(adapter)


def test_a_pattern_that_would_take_too_long_stops_at_its_timeout_as_a_user_error() -> None:
    from fp4prep.pipeline.inputs.adapter_files import check_config

    # Exponential in the regex engine too once the name is long: the timeout ends it.
    config = {"peft_type": "LORA", "alpha_pattern": {r"(?:a|a)*(?:a|a)*\.q": 2}}
    names = ["model.layers.0." + "a" * 200 + ".q_proj"]
    with pytest.raises(UserError, match="alpha_pattern key .* takes too long to match module names"):
        check_config(config, names)


def test_a_rank_pattern_gives_a_module_the_rank_its_matrices_have(llama_base: Path, tmp_path: Path) -> None:
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, r=4)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for kind, dim in (("lora_A", 0), ("lora_B", 1)):  # v_proj's pair cut to rank 2, as PEFT saves it
        key = f"base_model.model.model.layers.0.self_attn.v_proj.{kind}.weight"
        tensors[key] = tensors[key].narrow(dim, 0, 2).contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {"layers.0.self_attn.v_proj": 2}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    plan, _ = merge.plan(merge.load_adapter(adapter), TensorSource(llama_base))
    scaling = {u.target: u.scaling for u in plan}
    assert scaling["model.layers.0.self_attn.v_proj.weight"] == 8 / 2
    assert scaling["model.layers.1.self_attn.v_proj.weight"] == 8 / 4


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        # The config says r=4 for every module; one pair's matrices are rank 2: PEFT can't load it either.
        (("lora_A", "lora_B"), r"v_proj: its LoRA matrices have rank 2, but adapter_config.json gives it r=4"),
        # A and B disagree with each other.
        (("lora_A",), r"v_proj: its LoRA matrices \(2, 64\) and \(32, 4\) have different ranks"),
    ],
    ids=["config-rank", "pair-ranks"],
)
def test_an_adapter_whose_ranks_disagree_is_refused_at_upload_and_at_merge(
    llama_base: Path, tmp_path: Path, cut: tuple[str, ...], message: str
) -> None:
    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes, check_against_base

    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=TARGETS, r=4)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for kind in cut:
        key = f"base_model.model.model.layers.0.self_attn.v_proj.{kind}.weight"
        tensors[key] = tensors[key].narrow(0 if kind == "lora_A" else 1, 0, 2).contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    # The upload's check (with the catalogue's table of the base's shapes) and the merge say the same.
    with pytest.raises(UserError, match=message):
        check_against_base(shapes, config, base_weight_shapes(llama_base))
    with pytest.raises(UserError, match=message):
        merged_state(llama_base, adapter)
