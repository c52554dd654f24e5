"""fold_awq, our AWQ search, on one small decoder-shaped layer with ModelOpt's quantizers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fp4prep.pipeline import awq, fakequant, fold
from fp4prep.pipeline.recipes import RECIPES


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = (
            nn.Linear(width, 2 * width, bias=False),
            nn.Linear(width, 2 * width, bias=False),
        )
        self.down_proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The projections of a Llama decoder layer, under the names the fold groups use."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(width), Mlp(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.self_attn(x))


def activations(width: int = 64, outliers: bool = True) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 32, width, generator=generator) for _ in range(4)]
    if outliers:  # a few channels far larger than the rest, as LLM activations have
        for x in batches:
            x[..., :3] *= 40
    return batches


def quantize(layer: nn.Module, algorithm: dict[str, Any] | None, batches: list[torch.Tensor]) -> nn.Module:
    import modelopt.torch.quantization as mtq

    fakequant.register()
    awq.register()
    config = RECIPES["nvfp4"].quant_config(use_cpu_backend=True)
    config["algorithm"] = algorithm or "max"

    def forward_loop(model: nn.Module) -> None:
        for x in batches:
            model(x)

    return mtq.quantize(layer, config, forward_loop)


def output_error(quantized: nn.Module, reference: nn.Module, batches: list[torch.Tensor]) -> float:
    """Squared error of the quantized layer's output (W4A4, ModelOpt's quantizers) against BF16's."""
    with torch.no_grad():
        return sum(float((quantized(x) - reference(x)).pow(2).sum()) for x in batches)


@pytest.mark.parametrize("outliers", [True, False], ids=["outlier-channels", "plain"])
def test_the_search_never_does_worse_than_max_calibration_and_helps_where_channels_stand_out(
    outliers: bool,
) -> None:
    torch.manual_seed(0)
    reference = Layer()
    batches = activations(outliers=outliers)
    searched = quantize(copy.deepcopy(reference), {"method": "fold_awq", "alpha_step": 0.25}, batches)
    plain = quantize(copy.deepcopy(reference), None, batches)
    ratio = output_error(searched, reference, batches) / output_error(plain, reference, batches)
    assert ratio <= 1.0 + 1e-6
    if outliers:
        assert ratio < 0.9, ratio


def test_a_fold_group_gets_one_scale_and_projections_without_a_fold_target_get_none() -> None:
    torch.manual_seed(0)
    layer = quantize(Layer(), {"method": "fold_awq", "alpha_step": 0.25}, activations())
    scales = {
        name: m.input_quantizer.pre_quant_scale
        for name, m in layer.named_modules()
        if hasattr(m, "input_quantizer")
    }
    assert scales["self_attn.q_proj"] is not None  # the outlier channels make a scale worth it
    assert torch.equal(scales["self_attn.q_proj"], scales["self_attn.k_proj"])
    assert torch.equal(scales["self_attn.q_proj"], scales["self_attn.v_proj"])
    # The input's global amax follows the scaled activations, as folding into the norm will make them.
    q = layer.self_attn.q_proj
    assert torch.allclose(
        q.input_quantizer.amax.float(),
        (q.input_quantizer._amax_for_smoothing * scales["self_attn.q_proj"]).amax().float(),
    )


def test_row_targets_pair_every_down_proj_with_its_own_up_proj() -> None:
    assert fold.row_target("mlp.down_proj") == "mlp.up_proj"
    assert fold.row_target("mlp.experts.7.down_proj") == "mlp.experts.7.up_proj"
    assert fold.row_target("mlp.shared_experts.down_proj") == "mlp.shared_experts.up_proj"
    assert fold.row_target("self_attn.o_proj") is None


def test_the_attention_output_scale_is_tied_across_the_query_heads_of_one_key_value_head(
    make_base: Any,
) -> None:
    from transformers import AutoModelForCausalLM

    layer = AutoModelForCausalLM.from_pretrained(make_base("llama")).model.layers[0]
    tie = fold.head_tie(layer)
    assert tie == (2, 2, 16)  # 2 key-value heads, each read by 2 query heads, of 16 values
    scale = torch.rand(64) + 0.5
    shared = fold.tied(scale, tie).reshape(tie)
    assert torch.equal(shared[:, 0], shared[:, 1])
    assert torch.allclose(shared[0, 0], (scale.reshape(tie)[0].log().mean(0)).exp())


def test_folding_o_projs_tied_scale_into_v_proj_leaves_the_models_function_unchanged(make_base: Any) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    fakequant.register()
    awq.register()
    config = RECIPES["nvfp4"].quant_config(use_cpu_backend=True)
    config["algorithm"] = {"method": "fold_awq", "fold_attention_output": True, "layerwise": {"enable": True}}
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(model, config, lambda m: m(tokens))
    factors = fold.fold_pre_quant_scales(model)
    assert [n for n, f in factors.items() if n.endswith("self_attn.v_proj.weight") and "out_scale" in f], (
        factors.keys()
    )
    # Folding moves scales between weights and norms: with the quantizers off, the model it leaves is
    # the unquantized one, to float32 rounding (quantized, the moved scales round differently).
    with torch.no_grad(), set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}]):
        folded = model(tokens).logits
        original = reference(tokens).logits
    assert torch.allclose(folded, original, rtol=1e-4, atol=1e-5), (folded - original).abs().max()
