"""AWQ's search on routed experts: each expert's scale folded into its own up rows, exactly."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fp4prep.pipeline.algorithms import expert_awq, gptq
from fp4prep.pipeline.device import resolve
from fp4prep.pipeline.formats import FORMATS
from fp4prep.pipeline.modelopt_ext.session import Session
from fp4prep.pipeline.recipes import RECIPES, AwqSearch, Recipe
from tests.pipeline.algorithms.test_gptq import quantized_moe_block

CPU = resolve("cpu")


def outlier_batches(width: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(2, 64, width, generator=generator) for _ in range(3)]


def with_outlier_channels(block: nn.Module) -> None:
    """A few intermediate channels far larger than the rest (as trained experts have): up rows 0-2."""
    inner = block.experts.down_proj.shape[-1]
    block.experts.gate_up_proj.data[:, inner : inner + 3] *= 30


def test_each_expert_gets_its_own_searched_scale_and_the_fold_leaves_the_block_unchanged() -> None:
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import max_calibrate

    batches = outlier_batches()
    with Session(CPU), torch.no_grad():
        block, _ = quantized_moe_block()
        with_outlier_channels(block)
        reference = copy.deepcopy(block)
        groups = expert_awq.ExpertGroups(block)
        assert list(groups.modules) == ["experts"]
        max_calibrate(block, lambda m: [m(x) for x in batches])
        groups.remove()
        assert sorted(groups.groups) == [("experts", e) for e in range(4)]
        shared_amax = float(block.experts.down_proj_input_quantizer.amax)
        error_before = sum(float((block(x) - reference_out(reference, x)).square().sum()) for x in batches)

        factors = expert_awq.search_and_fold(groups, 0.25, 2048, "model.layers.0.mlp.")
        in_scale = factors["model.layers.0.mlp.experts.down_proj"]["in_scale"]
        out_scale = factors["model.layers.0.mlp.experts.gate_up_proj"]["out_scale"]
        assert in_scale.shape == (4, 32) and out_scale.shape == (4, 64)
        assert torch.equal(out_scale[:, :32], torch.ones(4, 32)) and torch.equal(out_scale[:, 32:], in_scale)
        scaled = [e for e in range(4) if not torch.equal(in_scale[e], torch.ones(32))]
        assert scaled, "the outlier channels should make a scale worth it for some expert"
        # One scale per expert: not all the same.
        assert len({tuple(in_scale[e].tolist()) for e in range(4)}) > 1
        # The shared input range follows the scaled inputs: the largest of the experts'.
        assert float(block.experts.down_proj_input_quantizer.amax) != shared_amax

        # Exact: with every quantizer off, the folded block computes what the original did.
        with set_quantizer_by_cfg_context(block, [{"quantizer_name": "*", "enable": False}]), \
                set_quantizer_by_cfg_context(reference, [{"quantizer_name": "*", "enable": False}]):
            for x in batches:
                torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)

        # Quantized (the folded experts' weight scales calibrated again), closer to the unquantized block.
        error_after = sum(float((block(x) - reference_out(reference, x)).square().sum()) for x in batches)
        assert error_after < error_before


def reference_out(reference: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    with set_quantizer_by_cfg_context(reference, [{"quantizer_name": "*", "enable": False}]):
        return reference(x)


def test_hessians_gathered_before_the_fold_are_carried_through_each_experts_scale() -> None:
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.model_calib import max_calibrate

    batches = outlier_batches()
    off = [{"quantizer_name": "*", "enable": False}]
    with Session(CPU), torch.no_grad():
        block, _ = quantized_moe_block()
        with_outlier_channels(block)
        groups = expert_awq.ExpertGroups(block)
        before = gptq.ExpertHessians(block, 1, range(4))
        max_calibrate(block, lambda m: [m(x) for x in batches])
        groups.remove()
        before.remove()
        factors = expert_awq.search_and_fold(groups, 0.25, 2048, "p.")
        before.fold(factors, "p.")
        after = gptq.ExpertHessians(block, 1, range(4))
        with set_quantizer_by_cfg_context(block, off):
            for x in batches:
                block(x)
        after.remove()
        for key, entry in after.inputs.items():
            torch.testing.assert_close(before.inputs[key].hessian, entry.hessian, rtol=1e-4, atol=1e-3)


class _ClampedExperts(nn.Module):
    """A gated expert whose activation clamps up (a SwiGLU limit, as DeepSeek-V4's and gpt-oss's)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 8))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)


class _PlainGatedExperts(_ClampedExperts):
    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate.float()) * up.float()


def test_experts_whose_activation_clamps_up_are_not_folded() -> None:
    with Session(CPU):
        block, _ = quantized_moe_block()
    assert expert_awq.foldable(block.experts)  # Mixtral's: act(gate) * up
    assert expert_awq.foldable(_PlainGatedExperts())
    assert not expert_awq.foldable(_ClampedExperts())
    transposed: Any = _PlainGatedExperts()
    transposed.is_transposed = True
    assert not expert_awq.foldable(transposed)


def test_folding_on_a_whole_moe_model_leaves_its_function_unchanged(make_base: Any) -> None:
    """The layer pass on tiny Mixtral and Glm4Moe models: routed experts' scales folded into their
    up rows beside the dense folds, nothing left as a pre_quant_scale, the model's function kept."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from transformers import AutoModelForCausalLM

    from fp4prep.pipeline.calibrate import calibrate

    for arch in ("mixtral", "glm4_moe"):
        model = AutoModelForCausalLM.from_pretrained(make_base(arch, name=arch), dtype=torch.float32)
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                with_outlier_channels_of(param)
        reference = copy.deepcopy(model)
        recipe = Recipe(FORMATS["nvfp4"], RECIPES["nvfp4"].thresholds, steps=(AwqSearch(alpha_step=0.25, routed_experts=True),))
        tokens = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
        with Session(CPU) as session:
            calibrated = calibrate(model, recipe, tokens.tolist(), CPU, session, lambda f: None)
        expert_factors = [n for n in calibrated.factors if n.endswith("experts.down_proj")]
        assert expert_factors, arch
        assert not [n for n, b in model.named_buffers() if "pre_quant_scale" in n]
        with torch.no_grad(), set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}]):
            folded = model(tokens).logits
            original = reference(tokens).logits
        assert torch.allclose(folded, original, rtol=1e-4, atol=1e-5), (arch, (folded - original).abs().max())


def with_outlier_channels_of(gate_up: torch.Tensor) -> None:
    inner = gate_up.shape[1] // 2
    with torch.no_grad():
        gate_up[:, inner : inner + 3] *= 30


def test_the_memory_check_counts_the_inputs_the_search_keeps() -> None:
    from fp4prep.pipeline.model.experts import meta_model
    from fp4prep.pipeline.preflight import awq_input_bytes
    from tests.tiny import tiny_config

    # Few tokens: all kept. Mixtral: q/k/v's input (64) and each token's two experts' down_proj
    # inputs (2 x 32 rows of 32) per layer.
    mixtral = meta_model(tiny_config("mixtral").to_json_string())
    assert awq_input_bytes(mixtral, 1000, 4) == 1000 * (64 + 2 * 32) * 4
    # Glm4Moe: the dense layer 0 is the widest: q/k/v (64), gate/up (64), down_proj (128).
    glm = meta_model(tiny_config("glm4_moe").to_json_string())
    assert awq_input_bytes(glm, 1000, 2) == 1000 * (64 + 64 + 128) * 2
    # Many tokens: about twice the scored tokens per group and per expert, whatever the corpus; the
    # MoE layer is now the widest: q/k/v (64), the shared expert's gate/up (64) and down (32), and
    # four experts' down_proj (32 each).
    many = 600_000
    batches = many // (4 * 512) + 1
    assert awq_input_bytes(glm, many, 2) == (2 * 2048 + batches) * (64 + 64 + 32 + 4 * 32) * 2


def test_the_search_keeps_about_the_tokens_it_scores_and_chooses_as_if_it_kept_all() -> None:
    from fp4prep.pipeline.algorithms import awq

    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    batches = [torch.randn(4, 256, 64) for _ in range(8)]
    batches[0][..., :3] *= 40
    chosen = []
    for keep in (1, awq.keep_every(8 * 4 * 256, 512)):
        with Session(CPU), torch.no_grad():
            import modelopt.torch.quantization as mtq
            from modelopt.torch.quantization.model_calib import max_calibrate

            from fp4prep.pipeline.modelopt_ext.quantizers import quant_config

            model = mtq.quantize(nn.Sequential(copy.deepcopy(linear)), {**quant_config(RECIPES["nvfp4"], CPU), "algorithm": "max"}, None)
            group = awq.Group([("0", model[0])], fused=False, keep_every=keep)
            handle = model[0].register_forward_pre_hook(lambda _m, args, g=group: g.observe(args[0]))
            max_calibrate(model, lambda m: [m(x) for x in batches])
            handle.remove()
            kept = sum(x.shape[0] for x in group.inputs)
            chosen.append((awq.choose(group, 0.25, 512), dict(group.losses), kept))
    (best_all, losses_all, kept_all), (best_few, losses_few, kept_few) = chosen
    assert kept_all == 8 * 4 * 256 and kept_few == 8 * 4 * 256 // 16
    assert best_all == best_few and losses_all == losses_few
