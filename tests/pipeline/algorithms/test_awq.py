"""The AWQ search on one small decoder-shaped layer with ModelOpt's quantizers, and folding its
scales away on a tiny model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fp4prep.pipeline.algorithms import awq, fold
from fp4prep.pipeline.device import resolve
from fp4prep.pipeline.formats import FORMATS
from fp4prep.pipeline.modelopt_ext.quantizers import quant_config
from fp4prep.pipeline.modelopt_ext.session import Session
from fp4prep.pipeline.recipes import RECIPES, AwqSearch, Recipe

CPU = resolve("cpu")


@pytest.fixture(autouse=True)
def session() -> Any:
    """ModelOpt's quantizers here run on the CPU backend, registered for each test."""
    with Session(CPU) as registered:
        yield registered


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


def quantize(layer: nn.Module, batches: list[torch.Tensor], alpha_step: float | None = None) -> nn.Module:
    """``layer`` with the NVFP4 recipe's quantizers, max-calibrated on ``batches``; with
    ``alpha_step``, its fold groups then given their searched scales (left as pre_quant_scales)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.model_calib import max_calibrate

    def forward_loop(model: nn.Module) -> None:
        for x in batches:
            model(x)

    with torch.no_grad():
        model = mtq.quantize(layer, {**quant_config(RECIPES["nvfp4"], CPU), "algorithm": "max"}, None)
        groups = awq.fold_groups(model) if alpha_step else []
        handles = [m.register_forward_pre_hook(lambda _m, args, g=g: g.observe(args[0])) for g in groups for _, m in g.members[:1]]
        max_calibrate(model, forward_loop)
        for handle in handles:
            handle.remove()
        if alpha_step:
            awq.search_and_apply(groups, alpha_step, scored_tokens=2048)
    return model


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
    searched = quantize(copy.deepcopy(reference), batches, alpha_step=0.25)
    plain = quantize(copy.deepcopy(reference), batches)
    ratio = output_error(searched, reference, batches) / output_error(plain, reference, batches)
    assert ratio <= 1.0 + 1e-6
    if outliers:
        assert ratio < 0.9, ratio


def test_a_fold_group_gets_one_scale_and_projections_without_a_fold_target_get_none() -> None:
    torch.manual_seed(0)
    layer = quantize(Layer(), activations(), alpha_step=0.25)
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


def test_folding_the_searched_scales_leaves_the_models_function_unchanged(make_base: Any) -> None:
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from transformers import AutoModelForCausalLM

    from fp4prep.pipeline.calibrate import calibrate

    model = AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32)
    reference = copy.deepcopy(model)
    recipe = Recipe(FORMATS["nvfp4"], RECIPES["nvfp4"].thresholds, steps=(AwqSearch(alpha_step=0.25),))
    tokens = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    with Session(CPU) as session:
        calibrated = calibrate(model, recipe, tokens.tolist(), CPU, session, lambda f: None)
    # Scales went into norms and up_proj's rows (down_proj's), and no pre_quant_scale is left.
    assert [n for n, f in calibrated.factors.items() if n.endswith("mlp.up_proj.weight") and "out_scale" in f]
    assert [n for n, f in calibrated.factors.items() if n.endswith("self_attn.q_proj.weight") and "in_scale" in f]
    assert not [n for n, b in model.named_buffers() if "pre_quant_scale" in n]
    # Folding moves scales between weights and norms: with the quantizers off, the model it leaves is
    # the unquantized one, to float32 rounding (quantized, the moved scales round differently).
    with torch.no_grad(), set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}]):
        folded = model(tokens).logits
        original = reference(tokens).logits
    assert torch.allclose(folded, original, rtol=1e-4, atol=1e-5), (folded - original).abs().max()
