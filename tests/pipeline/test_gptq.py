"""GPTQ's update on the CPU: the same rounding as ModelOpt's reference algorithm, much faster, and
Hessians shared by the projections that read one input."""

from __future__ import annotations

import pytest
import torch
from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse, gptq_blockwise_update
from torch import nn

from fp4prep.pipeline.algorithms import gptq
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
    weight, h_inv, scales = problem()
    reference = weight.clone()
    # ModelOpt's own column-by-column algorithm, quantizing the whole matrix for every column.
    gptq_blockwise_update(reference, h_inv, 128, lambda w: round_to_nearest(w, scales))
    ours = weight.clone()
    gptq.gptq_update(ours, h_inv, scales, 16, 128)
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
        gptq.gptq_update(weight, h_inv, scales, 16, 120)


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
