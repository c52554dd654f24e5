"""GPTQ's update on the CPU: the same rounding as ModelOpt's reference algorithm, much faster, and
Hessians shared by the projections that read one input."""

from __future__ import annotations

import pytest
import torch
from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse, gptq_blockwise_update
from torch import nn

from fp4prep.pipeline.algorithms import gptq, gptq_update
from fp4prep.pipeline.formats import numerics


def problem(rows: int = 576, columns: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight, the upper Cholesky factor of its damped inverse Hessian, and static NVFP4 scales."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, columns, generator=generator) * 0.02
    # Correlated inputs with a few loud channels, as LLM activations are.
    x = torch.randn(2048, columns, generator=generator) @ (torch.eye(columns) + 0.3 * torch.randn(columns, columns, generator=generator) / columns**0.5)
    x[:, :4] *= 20
    h_inv = compute_hessian_inverse(x.T @ x / len(x), weight, 0.01)
    amax = weight.abs().reshape(rows, columns // 16, 16).amax(-1)
    return weight, h_inv, numerics.static_nvfp4_scales(amax, amax.amax())


def round_to_nearest(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, columns = weight.shape
    return numerics.quantize_to_scales(weight.reshape(rows, columns // 16, 16), scales[..., None]).reshape(rows, columns)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_the_update_rounds_as_modelopts_reference_does(compile: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP4PREP_COMPILE", "1" if compile else "0")
    monkeypatch.setattr(gptq_update._round_group, "compile_after", 0)  # compiled from the first group
    weight, h_inv, scales = problem()
    reference = weight.clone()
    # ModelOpt's own column-by-column algorithm, quantizing the whole matrix for every column.
    gptq_blockwise_update(reference, h_inv, 128, lambda w: round_to_nearest(w, scales))
    ours = weight.clone()
    gptq_update.gptq_update(ours, h_inv, scales, 16, 128)
    if compile:  # a process compiles once it has rounded enough groups: the values may not change then
        monkeypatch.setenv("FP4PREP_COMPILE", "0")
        eager = weight.clone()
        gptq_update.gptq_update(eager, h_inv, scales, 16, 128)
        assert torch.equal(ours, eager)
    # The same codes but where summing in another order lands a value on the other side of a
    # rounding boundary: a handful in 147,456.
    assert (ours != reference).float().mean() < 1e-3
    assert torch.equal(ours, round_to_nearest(ours, scales))  # on the grid of the fixed scales

    def output_error(w: torch.Tensor) -> float:
        h = torch.linalg.inv(h_inv.T @ h_inv)  # the damped Hessian back
        d = w - weight
        return float((d @ h * d).sum())

    assert output_error(ours) == pytest.approx(output_error(reference), rel=1e-3)
    assert output_error(ours) < 0.8 * output_error(round_to_nearest(weight, scales))


def test_the_update_refuses_columns_that_do_not_split_into_scale_blocks() -> None:
    weight, h_inv, scales = problem(rows=32)
    with pytest.raises(Exception, match="groups of 16"):
        gptq_update.gptq_update(weight, h_inv, scales, 16, 120)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_activation_order_rounds_the_loud_inputs_first_and_keeps_each_block_on_its_own_scale(fmt: str) -> None:
    """Inputs whose channels differ in loudness, the loud ones stored last: rounded loudest first,
    the quiet columns absorb the loud ones' rounding error, and the layer's outputs move less than
    in stored order; every value is still on its block's grid (scales fixed in stored order)."""
    import copy

    import modelopt.torch.quantization as mtq

    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.quantizers import quant_config
    from fp4prep.pipeline.modelopt_ext.session import Session
    from fp4prep.pipeline.recipes import RECIPES

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 128, generator=generator) @ (torch.eye(128) + 0.3 * torch.randn(128, 128, generator=generator) / 128**0.5)
    x[:, -8:] *= 30  # loud channels, stored last
    hessian = x.T @ x / len(x)
    errors = {}
    with Session(resolve("cpu")), torch.no_grad():
        linear = nn.Linear(128, 256, bias=False)
        nn.init.normal_(linear.weight, std=0.05, generator=generator)
        original = linear.weight.detach().clone()
        quantized = mtq.quantize(linear, {**quant_config(RECIPES[fmt], resolve("cpu")), "algorithm": "max"}, None)
        for order in (False, True):
            module = copy.deepcopy(quantized)
            module.weight.data.copy_(original)
            gptq.quantize_layer(module, _one_input(module, x), "", {}, 0.01, order)
            rounded = module.weight.detach().float()
            grid = module.weight_quantizer(rounded) if fmt == "nvfp4" else numerics.mxfp4_fake_quant(rounded, 32)
            assert torch.equal(grid.float(), rounded)  # on its blocks' grid
            d = rounded - original
            errors[order] = float((d @ hessian * d).sum())
    assert errors[True] < 0.9 * errors[False]


def test_mxfp4_best_steps_keep_whichever_of_two_powers_rounds_each_block_with_less_output_error() -> None:
    """``best``: per block, the ceiling's step or the next finer one (its loudest values saturating),
    whichever moves the outputs less; never worse than either rule alone, and it does pick each."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=generator) * 0.4
    weight[:128, ::32] = 3.2  # one value just past the finer grid's 3: saturating it costs little
    weight[128:, :] = torch.where(weight[128:, :] > 0, 5.5, -5.5)  # every value near 6: the coarse grid's
    energy = torch.rand(128, generator=generator) + 0.5  # each column's input energy (a Hessian's diagonal)

    def error(steps: torch.Tensor) -> torch.Tensor:
        blocks = weight.reshape(256, 4, 32)
        return ((numerics.quantize_to_scales(blocks, steps[..., None]) - blocks).square() * energy.reshape(1, 4, 32)).sum(-1)

    steps = {rule: numerics.mxfp4_steps(weight, 32, rule, energy) for rule in ("ceil", "nearest", "best")}
    assert torch.all(error(steps["best"]) <= torch.minimum(error(steps["ceil"]), error(steps["nearest"])) + 1e-6)
    assert torch.all(steps["best"][:128] == steps["ceil"][:128] / 2) and torch.all(steps["best"][128:] == steps["ceil"][128:])
    assert torch.equal(steps["nearest"], torch.exp2(numerics.mxfp4_exponents(weight, 32, nearest=True)))


def _one_input(module: nn.Module, x: torch.Tensor) -> gptq.Hessians:
    """``module``'s Hessians, gathered from ``x`` in one batch."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    hessians = gptq.Hessians(module)
    with set_quantizer_by_cfg_context(module, [{"quantizer_name": "*", "enable": False}]):
        module(x)
    hessians.remove()
    return hessians


class Attention(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, 16), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x) * self.k_proj(x).repeat(1, 1, 2))


def test_projections_that_read_one_input_share_one_hessian() -> None:
    import modelopt.torch.quantization as mtq

    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.quantizers import quant_config
    from fp4prep.pipeline.modelopt_ext.session import Session
    from fp4prep.pipeline.recipes import RECIPES

    torch.manual_seed(0)
    cpu = resolve("cpu")
    batches = [torch.randn(2, 8, 32) for _ in range(3)]
    with Session(cpu), torch.no_grad():
        config = {**quant_config(RECIPES["nvfp4"], cpu), "algorithm": "max"}
        layer = mtq.quantize(Attention(), config, None)
        hessians = gptq.Hessians(layer)
        for x in batches:
            layer(x)
        hessians.remove()
    assert sorted(hessians.inputs) == ["o_proj", "q_proj"]
    assert hessians.inputs["q_proj"].names == ["q_proj", "k_proj"]
    flat = torch.cat([x.reshape(-1, 32) for x in batches])
    assert hessians.inputs["q_proj"].tokens == 48
    torch.testing.assert_close(hessians.inputs["q_proj"].hessian, flat.T @ flat)


def quantized_moe_block() -> tuple[nn.Module, nn.Module]:
    """Mixtral's sparse MoE block (4 experts, top-2) as ModelOpt quantizes it for NVFP4, and its
    unquantized twin."""
    import copy

    import modelopt.torch.quantization as mtq
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.quantizers import quant_config
    from fp4prep.pipeline.recipes import RECIPES

    config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.1)
    twin = copy.deepcopy(block)
    cpu = resolve("cpu")
    return mtq.quantize(block, {**quant_config(RECIPES["nvfp4"], cpu), "algorithm": "max"}, None), twin


def test_each_routed_expert_is_rounded_with_the_hessians_of_the_tokens_routed_to_it() -> None:
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.session import Session

    batches = [torch.randn(2, 48, 64) for _ in range(3)]
    with Session(resolve("cpu")), torch.no_grad():
        block, twin = quantized_moe_block()
        original = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
        collector = gptq.ExpertHessians(block, 1, range(4))
        with set_quantizer_by_cfg_context(block, [{"quantizer_name": "*", "enable": False}]):
            for x in batches:
                block(x)
        collector.remove()

        flat = torch.cat([x.reshape(-1, 64) for x in batches])
        _, _, chosen = twin.gate(flat)
        for e in range(4):
            rows = flat[(chosen == e).any(-1)]  # the tokens routed to expert e, and only those
            gate, up = nn.functional.linear(rows, original[0][e]).chunk(2, dim=-1)
            for proj, x in (("gate_up_proj", rows), ("down_proj", twin.experts.act_fn(gate) * up)):
                entry = collector.inputs[("experts", proj, e)]
                assert entry.tokens == len(x)
                torch.testing.assert_close(entry.hessian, x.T @ x)

        counts = gptq.quantize_experts(collector, 0.01)
        assert counts == {"experts": [8, 0]}  # 4 experts x 2 projections, each > its input width
        for e in range(4):
            rows = flat[(chosen == e).any(-1)]
            quantizer = block.experts.gate_up_proj_weight_quantizers[e]
            rounded = block.experts.gate_up_proj[e]
            reference = original[0][e].clone()
            hessian = collector.inputs[("experts", "gate_up_proj", e)]
            gptq._update([gptq._ExpertSlice(reference, quantizer)], hessian.hessian / hessian.tokens, 0.01)
            assert torch.equal(rounded, reference)  # the expert's own slice, Hessian and quantizer

            def output_error(w: torch.Tensor, e: int = e, rows: torch.Tensor = rows, q: nn.Module = quantizer) -> float:
                return float((rows @ (q(w) - original[0][e]).T).square().sum())

            assert output_error(rounded) < 0.9 * output_error(original[0][e])  # better than rounding to nearest


def test_an_expert_fewer_tokens_reached_than_its_input_width_keeps_max_calibration() -> None:
    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.session import Session

    with Session(resolve("cpu")), torch.no_grad():
        block, _ = quantized_moe_block()
        before = block.experts.gate_up_proj.detach().clone()
        collector = gptq.ExpertHessians(block, 1, range(4))
        block(torch.randn(1, 20, 64))  # 20 tokens x top-2: no expert sees 64
        collector.remove()
        assert gptq.quantize_experts(collector, 0.01) == {"experts": [0, 8]}
        assert torch.equal(block.experts.gate_up_proj, before)


def test_the_experts_are_gathered_in_chunks_that_fit_the_budget() -> None:
    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext.session import Session

    with Session(resolve("cpu")):
        block, _ = quantized_moe_block()
    per_expert = 4 * (64 * 64 + 32 * 32)
    assert gptq.expert_chunks(block, 10 * per_expert) == [range(0, 4)]
    assert gptq.expert_chunks(block, 3 * per_expert) == [range(0, 3), range(3, 4)]
    assert gptq.expert_chunks(block, 1) == [range(e, e + 1) for e in range(4)]


def test_the_memory_check_counts_one_chunk_of_expert_hessians_and_a_releases_cross_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4prep.pipeline.model.experts import meta_model
    from fp4prep.pipeline.preflight import gptq_hessian_bytes
    from tests.tiny import tiny_config

    model = meta_model(tiny_config("mixtral").to_json_string())  # hidden 64, 4 experts of 32, 2 layers
    linear = 4 * 4 * 64**2  # q, k, v, o: 64 inputs each
    per_expert = 4 * (64**2 + 32**2)
    assert gptq_hessian_bytes(model) == linear + 4 * per_expert
    # A release's rounding keeps a cross term beside each Hessian: twice the matrices per input.
    assert gptq_hessian_bytes(model, 2) == 2 * linear + 4 * 2 * per_expert
    monkeypatch.setenv("FP4PREP_EXPERT_HESSIAN_MIB", "0")
    assert gptq_hessian_bytes(model) == linear + per_expert
    assert gptq_hessian_bytes(model, 2) == 2 * linear + 2 * per_expert
