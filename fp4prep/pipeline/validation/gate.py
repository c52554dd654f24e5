"""The quality gate: every way a checkpoint falls short of its recipe's bar."""

from __future__ import annotations

from collections.abc import Sequence

from .. import serving
from ..config import ParityReport, RetentionReport, ServingReport
from ..recipes import Thresholds


def misses(
    thresholds: Thresholds, parity: ParityReport | None, reload_diff: float, kept: RetentionReport | None
) -> list[str]:
    """Every way the checkpoint falls short of its recipe's bar, as sentences (its parity's only
    where ``parity`` is given: numerics no GPU it is served on runs are not held)."""
    failures = []
    if reload_diff > thresholds.reload_max_logit_diff:
        failures.append(
            f"the reloaded checkpoint's logits differ from the calibrated model's by {reload_diff:.3f} "
            f"(at most {thresholds.reload_max_logit_diff})"
        )
    if parity is not None:
        failures += _parity_misses(thresholds, parity)
    if kept is not None and kept.pooled < thresholds.adapter_retention:
        failures.append(
            f"only {kept.pooled:.2f} of the adapter's change survived quantization "
            f"(at least {thresholds.adapter_retention}): was the base already quantized?"
        )
    return failures


def _parity_misses(thresholds: Thresholds, parity: ParityReport) -> list[str]:
    failures = []
    if parity.continuation_top1 < thresholds.continuation_top1:
        failures.append(
            f"top-1 agreement on the BF16 model's own continuations {parity.continuation_top1:.3f} "
            f"< {thresholds.continuation_top1}"
        )
    if parity.answer_kl > thresholds.answer_kl:
        failures.append(f"mean KL on the assistant turns {parity.answer_kl:.3f} > {thresholds.answer_kl}")
    if parity.identical_greedy < thresholds.identical_greedy:
        failures.append(f"identical greedy share {parity.identical_greedy:.3f} < {thresholds.identical_greedy}")
    return failures


def held(
    thresholds: Thresholds,
    declared: ParityReport,
    reload_diff: float,
    kept: RetentionReport | None,
    served: Sequence[ServingReport],
    quantization: str,
    hardware: Sequence[str],
) -> list[str]:
    """What the gate holds the checkpoint to on the GPUs it is served on: the declared numerics where
    some GPU runs them (or can be told to), and every served numerics no vLLM setting avoids."""
    runs_declared = not hardware or any(
        (n := serving.numerics_on(quantization, h)) is None or n.as_declared_flag for h in hardware
    )
    missed = misses(thresholds, declared if runs_declared else None, reload_diff, kept)
    for report in served:
        numerics = serving.by_key(report.numerics)
        if numerics is not None and not numerics.as_declared_flag:
            missed += [f"served on {', '.join(report.hardware)} ({report.numerics}): {m}" for m in report.misses]
    return missed
