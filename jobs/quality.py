"""The job page's quality report: the pipeline's figures as rows and as a BF16-vs-FP4 bar chart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bar:
    label: str
    bf16: float
    fp4: float
    bf16_text: str
    fp4_text: str
    scale: float  # the larger of the two, or 1 for fractions

    @property
    def bf16_width(self) -> float:
        return round(100 * self.bf16 / self.scale, 1) if self.scale else 0.0

    @property
    def fp4_width(self) -> float:
        return round(100 * self.fp4 / self.scale, 1) if self.scale else 0.0


@dataclass(frozen=True)
class Figure:
    label: str
    value: str
    hint: str = ""


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def chart(report: dict[str, Any]) -> list[Bar]:
    """BF16 merged model vs the FP4 checkpoint, metric by metric (the BF16 model is the reference
    for agreement figures, so it scores 100% there by definition)."""
    bars: list[Bar] = []
    task = report.get("task")
    if task:
        bars.append(Bar("Adapter task success", task["bf16_success"], task["quantized_success"],
                        _percent(task["bf16_success"]), _percent(task["quantized_success"]), 1.0))
    parity = report.get("parity")
    if parity:
        bars.append(Bar("Greedy continuation identical", 1.0, parity["identical_greedy"], "100% (reference)",
                        _percent(parity["identical_greedy"]), 1.0))
        bars.append(Bar("Top-1 agreement on BF16's own answers", 1.0, parity["continuation_top1"], "100% (reference)",
                        _percent(parity["continuation_top1"]), 1.0))
        bars.append(Bar("Top-1 agreement on assistant turns", 1.0, parity["answer_top1"], "100% (reference)",
                        _percent(parity["answer_top1"]), 1.0))
    if report.get("bf16_bytes") and report.get("output_bytes"):
        bf16, fp4 = float(report["bf16_bytes"]), float(report["output_bytes"])
        bars.append(Bar("Checkpoint size", bf16, fp4, _gb(bf16), _gb(fp4), max(bf16, fp4)))
    return bars


def figures(report: dict[str, Any]) -> list[Figure]:
    rows: list[Figure] = []
    parity = report.get("parity")
    if parity:
        rows.append(Figure("Mean KL divergence from BF16 on assistant turns", f"{parity['answer_kl']:.4f}",
                           f"over {parity['answer_tokens']} answer tokens of {parity['prompts']} held-out conversations"))
        rows.append(Figure("Over whole conversations", f"top-1 {_percent(parity['top1_agreement'])}, KL {parity['mean_kl']:.4f}",
                           f"{parity['tokens']} tokens, most of them the user's text"))
    retention = report.get("retention")
    if retention:
        rows.append(Figure("Adapter change retained", _percent(retention["pooled"]),
                           f"median tensor {_percent(retention['median'])}, worst {_percent(retention['minimum'])}"))
    if "reload_max_logit_diff" in report:
        rows.append(Figure("Independent reload, max logit difference", f"{report['reload_max_logit_diff']:.2e}"))
    seconds = report.get("stage_seconds") or {}
    if seconds:
        rows.append(Figure("Pipeline time", f"{sum(seconds.values()):.1f} s",
                           ", ".join(f"{stage} {s:.1f} s" for stage, s in seconds.items())))
    if report.get("device"):
        resumed = report.get("resumed_from_layer")
        rows.append(Figure("Computed on", report["device"],
                           f"resumed after {resumed} calibrated layers of an earlier run" if resumed else "one layer at a time"))
    return rows
