"""The formats' numerics reproduce ModelOpt's own NVFP4/MXFP4 quantize-dequantize, bit for bit, compiled
or eager, and the CPU backend that runs them for ModelOpt's quantizers."""

from __future__ import annotations

import pytest
import torch
from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

from fp4prep.pipeline.formats import compiled, numerics
from fp4prep.pipeline.modelopt_ext import backend


def tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    gaussian = torch.randn(48, 256) * 0.05
    with_zero_blocks = gaussian.clone()
    with_zero_blocks[3, :32] = 0
    tiny = torch.randn(16, 128) * 1e-6
    outliers = gaussian.clone()
    outliers[::7, ::13] *= 300
    # Exact E2M1 midpoints (0.25, 0.75, ...) after scaling: the tie rules must agree.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8).reshape(2, 32)
    ties = torch.cat([ties, -ties])
    return [gaussian, with_zero_blocks, tiny, outliers, ties]


NVFP4 = {"compiled": numerics.nvfp4_fake_quant, "eager": numerics.nvfp4_fake_quant.eager}
MXFP4 = {"compiled": numerics.mxfp4_fake_quant, "eager": numerics.mxfp4_fake_quant.eager}


@pytest.mark.parametrize("path", ["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index", range(5))
def test_nvfp4_matches_modelopts_qtensor(index: int, dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics.nvfp4_fake_quant, "min_values", 0)  # these tensors are small: compile them anyway
    x = tensors()[index].to(dtype)
    packed, scale, scale_2 = NVFP4QTensor.quantize(x, 16)
    expected = packed.dequantize(dtype=dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    got = NVFP4[path](x, 16, x.abs().amax())
    assert got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("path", ["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index", range(5))
def test_mxfp4_matches_modelopts_qtensor(index: int, dtype: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics.mxfp4_fake_quant, "min_values", 0)
    x = tensors()[index].to(dtype)
    packed, exponents = MXFP4QTensor.quantize(x, 32)
    expected = packed.dequantize(dtype=dtype, scale=exponents, block_sizes={-1: 32})
    got = MXFP4[path](x, 32)
    assert torch.equal(got, expected)


def test_the_compiled_path_compiles_here_and_equals_eager_on_activations() -> None:
    # Activations arrive as [batch, tokens, features] with a calibrated global amax; big enough to compile.
    torch.manual_seed(1)
    x = torch.randn(4, 119, 576) * torch.logspace(-3, 1, 576)
    assert x.numel() >= compiled.MIN_VALUES
    amax = x.abs().amax() * 1.3
    assert torch.equal(numerics.nvfp4_fake_quant(x, 16, amax), NVFP4["eager"](x, 16, amax))
    assert torch.equal(numerics.mxfp4_fake_quant(x, 32), MXFP4["eager"](x, 32))
    assert numerics.nvfp4_fake_quant.available and numerics.mxfp4_fake_quant.available, "compiling fell back to eager torch"


def test_compiled_quantization_compiles_once_per_width_and_dtype_not_per_row_count() -> None:
    # Rows vary from call to call (tokens, a projection's outputs) without a new graph; each width
    # gets its own, whose block loop the compiler sees whole. Values equal eager torch's throughout.
    from torch._dynamo.utils import counters

    torch.manual_seed(2)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    amax = torch.tensor(3.0)
    first = torch.randn(911, 640, dtype=torch.bfloat16)
    assert torch.equal(numerics.nvfp4_fake_quant(first, 16, amax), NVFP4["eager"](first, 16, amax))
    before = graphs()
    for rows in (1023, 4097, 513):  # each big enough to compile
        x = torch.randn(rows, 640, dtype=torch.bfloat16)
        assert x.numel() >= compiled.MIN_VALUES
        assert torch.equal(numerics.nvfp4_fake_quant(x, 16, amax), NVFP4["eager"](x, 16, amax))
    assert graphs() == before
    wider = torch.randn(700, 1536, dtype=torch.bfloat16)
    assert torch.equal(numerics.nvfp4_fake_quant(wider, 16, amax), NVFP4["eager"](wider, 16, amax))
    assert graphs() == before + 1
    assert numerics.nvfp4_fake_quant.available


def test_nvfp4_uses_a_calibrated_global_amax_not_the_tensors_own() -> None:
    x = tensors()[0]
    calibrated = x.abs().amax() * 3.7
    packed, scale, scale_2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=calibrated / 2688)
    expected = packed.dequantize(dtype=x.dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(numerics.nvfp4_fake_quant(x, 16, calibrated), expected)
    assert not torch.equal(numerics.nvfp4_fake_quant(x, 16, x.abs().amax()), expected)


def test_e2m1_rounds_half_to_even_for_nvfp4_and_down_for_mxfp4() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    assert numerics.e2m1_round(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert numerics.e2m1_round(mids, ties_to_even=False).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # The table form on magnitudes: the same values at every tie, every float next to one, and beyond.
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(8)), torch.nextafter(mids, torch.full((8,), 9.0))])
    magnitudes = torch.cat([near, torch.rand(100_000) * 7, torch.zeros(1), torch.tensor([6.0, 1e30])])
    assert torch.equal(numerics.e2m1_round_magnitudes(magnitudes), numerics.e2m1_round(magnitudes))


def test_mxfp4_nearest_exponents_are_compressed_tensors_block_scales() -> None:
    """``nearest``: compressed-tensors' E8M0 rule (the block's largest value to the nearest power of
    two, up from a mantissa of 1.75, less E2M1's 2); the default: the smallest step holding the block."""
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=generator) * torch.logspace(-6, 3, 512).unsqueeze(1)
    x[:3, :32] = 0
    x[:3, 0] = torch.tensor([6.5, 7.0, 6.0])  # between 6 and 7 steps of 1: the finer grid; 7: the coarser
    amax = x.reshape(-1, 32).abs().amax(-1)
    assert torch.equal(numerics.mxfp4_exponents(x, 32, nearest=True).flatten(), generate_mx_scales(amax) - 127)
    assert numerics.mxfp4_exponents(x, 32, nearest=True).flatten()[[0, 2, 4]].tolist() == [0.0, 1.0, 0.0]
    assert numerics.mxfp4_exponents(x, 32).flatten()[[0, 2, 4]].tolist() == [1.0, 1.0, 0.0]


def test_fp8_matches_what_modelopts_export_writes_and_engines_read() -> None:
    w = tensors()[0].to(torch.bfloat16)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = amax.float() / 448
    stored = (w / scale).to(torch.float8_e4m3fn)  # ModelOpt's to_quantized_weight for FP8
    expected = (stored.float() * scale).to(torch.bfloat16)  # vLLM: fp8 * weight_scale
    assert torch.equal(numerics.fp8_fake_quant(w, amax), expected)


def test_the_backend_handles_only_block_fp4_and_fp8() -> None:
    from modelopt.torch.quantization.nn import TensorQuantizer

    int8 = TensorQuantizer()
    with pytest.raises(NotImplementedError, match="E2M1"):
        backend.CpuBackend()(torch.ones(4, 16), int8)
