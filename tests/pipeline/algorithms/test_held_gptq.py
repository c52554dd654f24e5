"""Rounding a changed weight onto the block scales its FP4 release holds: GPTQ, then coordinate
descent, each only lowering ``||(Q - W) X||²``, every value on the held grid."""

from __future__ import annotations

import torch

from fp4prep.pipeline.algorithms.gptq import BLOCK, gptq_rounding, gptq_update
from fp4prep.pipeline.algorithms.held_gptq import descend
from fp4prep.pipeline.algorithms.held_scales import nearest
from fp4prep.pipeline.formats.numerics import e2m1_round, scale_blocks


def _problem(rows: int = 48, columns: int = 128, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A base on the grid of power-of-two steps, a small change (a rank-2 product, under half a step
    mostly), and the Hessian of correlated inputs."""
    generator = torch.Generator().manual_seed(0)
    steps = torch.exp2(torch.randint(-6, -3, (rows, columns // group), generator=generator).float())
    base = scale_blocks(e2m1_round(torch.randn(rows, columns, generator=generator) * 2), steps)
    change = torch.randn(rows, 2, generator=generator) @ torch.randn(2, columns, generator=generator) * steps.mean() * 0.15
    mixing = torch.randn(columns, columns, generator=generator) / columns**0.5 + torch.eye(columns)
    x = torch.randn(4096, columns, generator=generator) @ mixing
    return base, base + change, steps, x.T @ x / x.shape[0]


def _error(q: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    return float((((q - w) @ h) * (q - w)).sum())


def _on_grid(q: torch.Tensor, steps: torch.Tensor) -> bool:
    values = q.reshape(*steps.shape, -1) / steps.unsqueeze(-1)
    return torch.equal(e2m1_round(values), values)


def test_gptq_then_descent_keep_more_of_a_small_change_than_nearest_and_stay_on_the_held_grid() -> None:
    from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse

    base, merged, steps, h = _problem()
    near = scale_blocks(nearest(merged, steps), steps)
    change = _error(base, merged, h)
    rounded = merged.clone()
    gptq_update(rounded, compute_hessian_inverse(h, merged, 0.01), steps, 32, BLOCK)
    after_gptq = _error(rounded, merged, h)
    descend(rounded, merged, h, steps, passes=4)
    after_descent = _error(rounded, merged, h)
    assert _on_grid(rounded, steps) and _on_grid(near, steps)
    assert after_descent <= after_gptq < _error(near, merged, h) <= change * 1.01
    assert 1 - after_descent / change > 0.3  # the share of the change in the outputs kept


def test_descent_never_makes_the_outputs_worse_and_leaves_a_weight_already_on_the_grid_alone() -> None:
    base, merged, steps, h = _problem(columns=64)
    start = scale_blocks(nearest(merged, steps), steps)
    rounded = start.clone()
    descend(rounded, merged, h, steps, passes=1)
    assert _error(rounded, merged, h) <= _error(start, merged, h)
    unchanged = base.clone()
    descend(unchanged, base, h, steps, passes=2)
    assert torch.equal(unchanged, base)


def test_rounding_on_the_prepared_models_inputs_aims_at_the_merged_models_outputs() -> None:
    """The layers before left the inputs off (``X~ = X - D``): the goal ``W + W D^T X~ H~^-1`` gives
    on ``X~`` what ``W`` gives on ``X``, as nearly as least squares can, and the weight rounded
    towards it on ``X~``'s Hessian (hooks pairing each token's two inputs) is closer to the merged
    outputs than the one rounded towards ``W``."""
    from modelopt.torch.quantization.utils.calib_utils import compute_hessian_inverse

    from fp4prep.pipeline.algorithms.held_gptq import _towards_merged
    from fp4prep.pipeline.algorithms.held_inputs import Paired

    base, merged, steps, _ = _problem()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, merged.shape[1], generator=generator)
    # Mostly a systematic distortion (what a layer's rounded weights do to every token), a little noise.
    distortion = torch.eye(x.shape[1]) + 0.1 * torch.randn(x.shape[1], x.shape[1], generator=generator) / x.shape[1] ** 0.5
    prepared = x @ distortion + 0.01 * torch.randn(x.shape, generator=generator)
    pair = Paired()
    for rows in range(0, x.shape[0], 1024):  # batch by batch, as the walk hands them over
        pair.add_pair(prepared[rows : rows + 1024], x[rows : rows + 1024])
    assert pair.hessian is not None and pair.cross is not None and pair.tokens == x.shape[0]
    h, cross = pair.hessian / pair.tokens, pair.cross / pair.tokens
    goal = merged + _towards_merged(merged, h, cross, damp=1e-6)
    best = torch.linalg.lstsq(prepared, x @ merged.T).solution.T

    def error(q: torch.Tensor) -> float:
        return float(((prepared @ q.T - x @ merged.T) ** 2).mean())

    assert torch.allclose(goal, best, atol=1e-3)
    assert error(goal) < 0.1 * error(merged)
    rounded = {}
    for name, aim in (("merged", merged), ("goal", goal)):
        q = aim.clone()
        gptq_update(q, compute_hessian_inverse(h, aim, 0.01), steps, 32, BLOCK)
        descend(q, aim, h, steps, passes=4)
        assert _on_grid(q, steps)
        rounded[name] = q
    assert error(rounded["goal"]) < 0.7 * error(rounded["merged"])


def test_activation_order_rounds_the_loud_inputs_first_on_each_columns_own_held_step() -> None:
    """A few inputs far louder than the rest: rounded first, their error is taken up by every other
    column instead of only the ones stored after them; every value stays on its own block's step."""
    base, merged, steps, h = _problem()
    loudness = torch.ones(h.shape[0])
    loudness[torch.arange(5, h.shape[0], 17)] = 6.0
    h = h * loudness[:, None] * loudness[None, :]
    errors = {}
    for order in (False, True):
        rounded = gptq_rounding(merged.clone(), h, steps, 32, 0.01, order)
        assert _on_grid(rounded, steps)
        errors[order] = _error(rounded, merged, h)
    assert errors[True] < 0.9 * errors[False]
