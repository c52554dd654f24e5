"""A quantized layer's input is quantized as vLLM 0.33.0 quantizes it, bit for bit.

The expected values are vLLM's own outputs, computed by vLLM's code on the CPU and stored in
data/vllm-0.33.0-activations.safetensors by ``benchmarks/engine_check.py vectors``:
- NVFP4: ``ref_nvfp4_quant_dequant`` in vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py,
  with the global scale ``1 / input_scale`` of ``KNvfp4Dynamic.process`` (quantization/modelopt.py);
- FP8 per token: ``QuantFP8.forward_native`` in vllm/model_executor/layers/quantization/input_quant_fp8.py.
The inputs span four decades per channel (blocks whose E4M3 scale underflows), an all-zero block
and E2M1 ties; the global scales lie above, at and far below the tensor's own amax.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp4prep.pipeline.formats import engine, numerics
from fp4prep.pipeline.modelopt_ext import backend

VECTORS = Path(__file__).parents[1] / "data" / f"vllm-{engine.VLLM_VERSION}-activations.safetensors"
SCALES = range(4)


@pytest.fixture(scope="module")
def vectors() -> dict[str, torch.Tensor]:
    with safe_open(VECTORS, "pt") as f:
        assert f.metadata() == {"vllm": engine.VLLM_VERSION}
    return load_file(VECTORS)


@pytest.mark.parametrize("path", ["compiled", "eager"])
@pytest.mark.parametrize("i", SCALES)
def test_nvfp4_inputs_match_vllm(vectors: dict[str, torch.Tensor], i: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.nvfp4_activations, "min_values", 0)  # small tensors: compile them anyway
    fn = engine.nvfp4_activations if path == "compiled" else engine.nvfp4_activations.eager
    x, expected = vectors["x"], vectors[f"nvfp4.{i}.out"]
    got = fn(x, vectors[f"nvfp4.{i}.global_scale"], 16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected), f"{int((got != expected).sum())} of {x.numel()} values differ"
    if path == "compiled":
        assert engine.nvfp4_activations.available, "compiling fell back to eager torch"


def test_the_vectors_reach_every_branch(vectors: dict[str, torch.Tensor]) -> None:
    x = vectors["x"].float()
    for i in SCALES:
        out = vectors[f"nvfp4.{i}.out"].float()
        blocks_in, blocks_out = x.reshape(-1, 16).abs().amax(-1), out.reshape(-1, 16).abs().amax(-1)
        if i == 0:  # global amax 4x the tensor's: quiet blocks' scales round to zero in E4M3
            assert int(((blocks_in > 0) & (blocks_out == 0)).sum()) > 100
        if i == 3:  # global amax 1% of the tensor's: values clip at 6 steps
            assert float(out.abs().max()) < float(x.abs().max()) / 10
    # ModelOpt's arithmetic, which fp4prep used for inputs before, differs exactly there.
    ours_before = numerics.nvfp4_fake_quant.eager(vectors["x"], 16, vectors["nvfp4.0.amax"])
    assert not torch.equal(ours_before, vectors["nvfp4.0.out"])


def test_fp8_per_token_inputs_match_vllm(vectors: dict[str, torch.Tensor]) -> None:
    got = engine.fp8_per_token_activations(vectors["x"])
    assert torch.equal(got, vectors["fp8.out"])
    # Dividing by the scale (ModelOpt's export arithmetic) instead of multiplying by its reciprocal differs.
    x = vectors["x"]
    assert not torch.equal(numerics.fp8_fake_quant(x, x.abs().amax(-1, keepdim=True)), vectors["fp8.out"])


def test_dense_fp8_layers_multiply_the_codes_and_scale_after_as_vllm_does(vectors: dict[str, torch.Tensor]) -> None:
    x, weight, scale = vectors["x"], vectors["fp8.linear.weight"], vectors["fp8.linear.weight_scale"]
    got = engine.fp8_linear(x, weight.to(torch.bfloat16), scale)  # the reader holds the codes in BF16
    assert got.dtype == torch.bfloat16 and torch.equal(got, vectors["fp8.linear.out"])
    # Both operands dequantized first, even in FP32, round where the kernel does not.
    codes, token_scale = engine.fp8_per_token_codes(x)
    dequantized = torch.nn.functional.linear(codes.float() * token_scale, numerics.dequantize_fp8(weight, scale))
    assert not torch.equal(dequantized.to(x.dtype), vectors["fp8.linear.out"])


def test_static_fp8_inputs_match_vllm(vectors: dict[str, torch.Tensor]) -> None:
    # Routed experts' FP8: one stored scale, some values clipped at 448 times it.
    got = engine.fp8_static_activations(vectors["x"], vectors["fp8.static.scale"])
    assert torch.equal(got, vectors["fp8.static.out"])


@pytest.mark.parametrize("i", range(3))
def test_marlin_keeps_the_nvfp4_block_scales_vllm_keeps(vectors: dict[str, torch.Tensor], i: int) -> None:
    from fp4prep.pipeline.validation.reader import marlin_floor, marlin_scale_factor

    scales = vectors[f"marlin.{i}.scales"]
    factor = marlin_scale_factor(float(scales.float().max()))
    assert factor == float(vectors[f"marlin.{i}.factor"])
    kept = marlin_floor(scales, factor).float() != 0
    assert torch.equal(kept, vectors[f"marlin.{i}.kept"]) and not kept.all()


def test_input_quantizers_run_the_engines_arithmetic(vectors: dict[str, torch.Tensor]) -> None:
    """ModelOpt's input quantizers, on fp4prep's input backend, compute vLLM's values from their amax."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    cfg = QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    quantizer = TensorQuantizer(cfg)
    # The calibrated amax, whose export stores input_scale = amax / 2688; vLLM's global scale is its reciprocal.
    quantizer.amax = vectors["nvfp4.1.amax"].reshape(())
    assert torch.equal(engine.nvfp4_global_scale_of(quantizer.amax), vectors["nvfp4.1.global_scale"].reshape(()))
    got = backend.InputBackend()(vectors["x"], quantizer)
    assert torch.equal(got, vectors["nvfp4.1.out"])


# --- MXFP4 on Blackwell: FlashInfer's kernel, branch by branch -------------------------------------
# (flashinfer/quantization/kernels/mxfp4_quantize.py with quantization_cute_dsl_utils.py, 0.7.2.post1,
# the version vLLM 0.33.0 requires: scale = amax * (1/6) rounded up to a power of two by its bits,
# values times the scale's exact inverse, cvt.rn.satfinite to E2M1.)


def _block(*values: float) -> torch.Tensor:
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, : len(values)] = torch.tensor(values)
    return x


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        # amax 6: amax/6 is a power of two, no mantissa bit, so no rounding up: scale 1. Ties go to
        # the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), unlike ModelOpt's ties down.
        ((6.0, 0.25, 0.75, 2.5, 5.0, -1.75), (6.0, 0.0, 1.0, 2.0, 4.0, -2.0)),
        # amax 6.5: amax/6 just above 1 rounds up to scale 2, and 6.5/2 = 3.25 -> 3.
        ((6.5, 1.0, 0.5), (6.0, 1.0, 0.0)),
        # All zero: scale code 0, inverse 0, the block stays zero.
        ((), ()),
        # amax/6 a subnormal at most half the smallest normal: code 0, the block is zeroed.
        ((6 * 2.0**-130,), (0.0,)),
        # amax/6 = 1.5 * 2**-127, a subnormal above half: rounds up to the smallest normal, 2**-126,
        # and 4.5 steps of it round to 4.
        ((9 * 2.0**-127,), (4 * 2.0**-126,)),
    ],
)
def test_mxfp4_inputs_follow_flashinfers_kernel(block: tuple[float, ...], expected: tuple[float, ...]) -> None:
    got = engine.mxfp4_activations(_block(*block))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _block(*expected)), got[0, : len(block)]


def test_mxfp4_scale_is_amax_over_6_rounded_up_to_a_power_of_two() -> None:
    """The bit-level rounding equals ceil(log2(v)) + 127 in exact arithmetic, where floating-point
    log2 (ModelOpt's weights) is off by one just above a power of two."""
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-120, 120, (4096,), generator=generator).double()
    v = (torch.rand(4096, generator=generator, dtype=torch.float64) + 1).mul(2.0**exponents).float()
    v[:8] = torch.tensor([1.0, 2.0**-100, 0.5, 3.0, 2.0**100, 1.0 + 2.0**-23, (1.0 + 2.0**-23) * 2.0**-40, 7.0])
    exact = torch.tensor([math.ceil(math.log2(float(value))) + 127 for value in v])
    assert torch.equal(engine._ue8m0_round_up(v).long(), exact)
    just_above = torch.tensor([(1.0 + 2.0**-23) * 2.0**-40])
    assert torch.ceil(torch.log2(just_above)) == -40  # float32 log2 loses the bit that rounds it up


def test_mxfp4_inputs_differ_from_modelopts_weight_arithmetic_only_at_ties() -> None:
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).mul(3).bfloat16()
    ours, modelopt = engine.mxfp4_activations(x), numerics.mxfp4_fake_quant.eager(x, 32)
    differ = ours != modelopt
    assert 0 < int(differ.sum()) < x.numel() // 50
    # Where they differ, x sat exactly halfway between two E2M1 steps of its block's scale.
    step = (ours.float() - modelopt.float()).abs()[differ]
    half = (x.float() - modelopt.float()).abs()[differ]
    assert torch.equal(half * 2, step)


def test_an_mxfp4_input_quantizer_runs_flashinfers_arithmetic() -> None:
    """A recipe that calibrates with MXFP4 inputs (W4A4 as vLLM runs it on Blackwell) sees them as
    FlashInfer quantizes them, not as ModelOpt's weight arithmetic would."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    cfg = QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = backend.InputBackend()(x, TensorQuantizer(cfg))
    assert torch.equal(got, engine.mxfp4_activations(x))
    assert not torch.equal(got, numerics.mxfp4_fake_quant.eager(x, 32))
