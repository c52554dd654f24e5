"""Mixed precision: GPTQ's rounding error per fused group, the worst groups chosen within a budget,
and a calibration that keeps them in FP8 while the recipe rounds the rest."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from fp4prep.pipeline.algorithms.mixed import GroupError, output_error, select
from fp4prep.pipeline.device import resolve
from fp4prep.pipeline.formats import FORMATS
from fp4prep.pipeline.modelopt_ext.session import Session
from fp4prep.pipeline.recipes import RECIPES, Recipe

CPU = resolve("cpu")


def group(name: str, error: float, weights: int) -> GroupError:
    return GroupError((name,), error, 1.0, weights)


def test_the_worst_groups_are_chosen_while_they_fit_the_budget() -> None:
    groups = [group("a", 0.05, 30), group("b", 0.20, 60), group("c", 0.10, 20), group("d", 0.0, 1), group("e", 0.08, 5)]
    # 100 weights in all; 25% of them: b (60) does not fit, c (20) does, then e (5).
    assert [g.names[0] for g in select(groups, 0.25, 100)] == ["c", "e"]
    assert [g.names[0] for g in select(groups, 0.85, 100)] == ["b", "c", "e"]
    # With room for all: every group worst first, but d, which rounding did not move, never.
    assert [g.names[0] for g in select(groups, 1.0, 116)] == ["b", "c", "e", "a"]
    assert select(groups, 0.0, 100) == []


def test_the_output_error_is_what_the_rounding_moved_the_outputs_by() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    weight = torch.randn(8, 16, generator=generator)
    rounded = weight + 0.01 * torch.randn(8, 16, generator=generator)
    error, reference = output_error(weight, rounded, x.T @ x / len(x))
    assert error == pytest.approx(float((x @ (rounded - weight).T).square().sum() / len(x)), rel=1e-4)
    assert reference == pytest.approx(float((x @ weight.T).square().sum() / len(x)), rel=1e-4)


def test_groups_kept_in_fp8_are_neither_searched_nor_rounded_and_the_rest_are(
    make_base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelopt.torch.quantization.utils import is_quantized_linear
    from transformers import AutoModelForCausalLM

    from fp4prep.pipeline.algorithms.layer_pass import LayerPass
    from fp4prep.pipeline.calibrate import calibrate

    original = AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32)
    tokens = torch.randint(0, original.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0)).tolist()
    recipe = RECIPES["nvfp4"]

    def calibrated(recipe: Recipe) -> tuple[torch.nn.Module, Any]:
        model = copy.deepcopy(original)
        with Session(CPU) as session:
            return model, calibrate(model, recipe, tokens, CPU, session, lambda f: None)

    _, first = calibrated(recipe)
    layers = original.config.num_hidden_layers
    assert first.layer_errors == {}  # measured only when asked: it costs a pass of each layer's inputs
    monkeypatch.setattr(LayerPass, "measure_layers", True)
    _, measured = calibrated(recipe)
    monkeypatch.undo()
    # Measuring changes nothing the recipe does; it says what each layer's quantization added to
    # its output (the residual stream), against that output's size, and its quantized weights.
    assert [g.to_list() for g in measured.rounding_errors] == [g.to_list() for g in first.rounding_errors]
    assert sorted(measured.layer_errors) == [f"model.layers.{i}." for i in range(layers)]
    per_layer = sum(m.weight.numel() for m in original.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    for error, size, weights in measured.layer_errors.values():
        assert 0 < error < size and weights == per_layer
    names = sorted(n for g in first.rounding_errors for n in g.names)
    assert names == sorted(
        f"model.layers.{i}.{p}" for i in range(layers)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    assert {g.names[0].split(".", 3)[-1]: len(g.names) for g in first.rounding_errors} == {
        "self_attn.q_proj": 3, "self_attn.o_proj": 1, "mlp.gate_proj": 2, "mlp.down_proj": 1
    }
    assert all(0 < g.relative < 1 for g in first.rounding_errors)
    total = sum(g.weights for g in first.rounding_errors)
    chosen = select(first.rounding_errors, 0.2, total)
    assert chosen and sum(g.weights for g in chosen) <= 0.2 * total
    fp8 = tuple(n for g in chosen for n in g.names)

    model, second = calibrated(dataclasses.replace(recipe, fp8_modules=fp8))
    assert not {n for g in second.rounding_errors for n in g.names} & set(fp8)
    assert {n for g in second.rounding_errors for n in g.names} == set(names) - set(fp8)
    for name, module in model.named_modules():
        if not is_quantized_linear(module):
            continue
        weight, inputs = module.weight_quantizer, module.input_quantizer
        if name in fp8:
            assert tuple(weight.num_bits) == (4, 3) and weight.axis == 0 and float(weight.amax.min()) > 0, name
            assert tuple(inputs.num_bits) == (4, 3) and inputs.is_enabled and inputs._dynamic, name
            # Neither folded nor rounded: the BF16 weights, quantized per output channel in FP8.
            assert torch.equal(module.weight, original.get_submodule(name).weight), name
        elif name.startswith("model.layers."):
            assert tuple(weight.num_bits) == (2, 1), name


def test_only_nvfp4_keeps_projections_in_fp8() -> None:
    with pytest.raises(ValueError, match="only NVFP4 mixes with FP8"):
        dataclasses.replace(RECIPES["mxfp4"], fp8_modules=("model.layers.0.mlp.down_proj",))
    assert "2 projections" in Recipe(
        FORMATS["nvfp4"], RECIPES["nvfp4"].thresholds, RECIPES["nvfp4"].steps, fp8_modules=("a", "b")
    ).calibration


def test_a_run_refuses_projections_kept_in_fp8_before_reading_anything(tmp_path: Any) -> None:
    from fp4prep.pipeline import PipelineConfig, PipelineError, run

    recipe = dataclasses.replace(RECIPES["nvfp4"], fp8_modules=("model.layers.0.mlp.down_proj",))
    missing = tmp_path / "no-such-base"
    with pytest.raises(PipelineError, match="does not export yet"):
        run(PipelineConfig(base_dir=missing, output_dir=tmp_path / "out", quantization="nvfp4", recipe=recipe))
    assert not (tmp_path / "out").exists()
