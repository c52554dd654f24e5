"""The validation report in words: the one place a run's figures become text.

Every reader of a run's report (``PipelineResult.to_dict()``: parity, task, retention, reload,
sizes, times) shows it through these: the local command's summary, the model card in the
checkpoint, the job and revision pages, and the demo. Torch-free, for the web process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Figure:
    label: str
    value: str
    hint: str = ""


@dataclass(frozen=True)
class Bar:
    """One metric for the BF16 merged model and the checkpoint, as bar lengths out of ``scale``."""

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


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _format(report: dict[str, Any]) -> str:
    return str(report.get("quantization") or "fp4").upper()


def headline(report: dict[str, Any]) -> list[str]:
    """The figures that decide whether the adapter survived, one line each."""
    lines = []
    parity = report.get("parity")
    if parity:
        lines.append(
            f"on answers: top-1 {parity['answer_top1']:.3f}, KL {parity['answer_kl']:.4f}; top-1 on the BF16 model's "
            f"continuations {parity['continuation_top1']:.3f}; identical greedy {parity['identical_greedy']:.2f} "
            f"({parity['prompts']} held-back prompts)"
        )
    task = report.get("task")
    if task:
        lines.append(
            f"adapter task: {task['bf16_success']:.0%} (BF16 merged) -> {task['quantized_success']:.0%} "
            f"({_format(report)}, {task['prompts']} prompts)"
        )
    for served in report.get("serving") or []:
        lines.append(f"served on {_hardware(served)}: {_serving_summary(served)}")
    release = report.get("release")
    if release:
        lines.append(
            f"in its FP4 release's own format: {release['copied']} tensors copied from the release byte for byte, "
            f"{release['requantized']} quantized weights the adapter changed given new codes on the release's scales, "
            f"{release['rewritten']} unquantized tensors it changed written merged"
        )
        lines += _release_rounding(release)
    return lines


def _release_rounding(release: dict[str, Any]) -> list[str]:
    """How the changed weights of a release were rounded, what they kept of the change in the
    layers' outputs, and which kept too little."""
    lines = [f"changed weights rounded {release['rounding']}"]
    kept, nearest = release.get("kept_in_outputs"), release.get("kept_in_outputs_nearest")
    if kept is not None:
        lines[0] += f": {kept:.0%} of the adapter's change in the layers' outputs kept ({nearest:.0%} rounding to nearest)"
    not_kept = release.get("not_kept") or {}
    if not_kept:
        shown = ", ".join(f"{name} {share:.0%}" for name, share in list(not_kept.items())[:10])
        more = f" and {len(not_kept) - 10} more" if len(not_kept) > 10 else ""
        lines.append(f"the adapter's change did not survive FP4 rounding in {len(not_kept)} weights (share kept): {shown}{more}")
    nearest_ones = release.get("rounded_to_nearest") or {}
    if nearest_ones:
        why = "; ".join(f"{n} ({reason})" for n, reason in list(nearest_ones.items())[:10])
        more = f" and {len(nearest_ones) - 10} more" if len(nearest_ones) > 10 else ""
        lines.append(f"{len(nearest_ones)} changed weights rounded to nearest, GPTQ having no inputs for them: {why}{more}")
    return lines


def _hardware(served: dict[str, Any]) -> str:
    return ", ".join(dict.fromkeys(served["hardware"]))


def _serving_summary(served: dict[str, Any]) -> str:
    """One profile's figures where the engine computes other than declared, and what they mean."""
    p, task = served["parity"], served.get("task")
    figures = f"on answers top-1 {p['answer_top1']:.3f}, KL {p['answer_kl']:.4f}; top-1 on the BF16 model's continuations {p['continuation_top1']:.3f}"
    if task:
        figures += f"; adapter task {task['quantized_success']:.0%}"
    verdict = (
        "misses the thresholds (" + "; ".join(served["misses"]) + ")" + (f"; serve it there with {served['as_declared_flag']}" if served.get("as_declared_flag") else "")
        if served["misses"] else "within the thresholds"
    )
    return f"{served['description']}: {figures}; {verdict}"


def serving_note(report: dict[str, Any], hardware: str) -> str:
    """What serving on ``hardware`` runs differently from the checkpoint's declared numerics, with
    the figures the run measured there; empty where nothing differs or the run did not measure it."""
    for served in report.get("serving") or []:
        if hardware in served["hardware"]:
            return _serving_summary(served)
    return ""


def figures(report: dict[str, Any]) -> list[Figure]:
    """Every figure of the report, labelled and explained."""
    rows: list[Figure] = []
    parity = report.get("parity")
    if parity:
        held = f"{parity['prompts']} held-back conversations"
        rows += [
            Figure("Top-1 agreement on the BF16 model's continuations", f"{parity['continuation_top1']:.4f}",
                   f"{parity['continuation_tokens']} tokens the BF16 model chose greedily"),
            Figure("Top-1 agreement / mean KL (nats) on assistant turns", f"{parity['answer_top1']:.4f} / {parity['answer_kl']:.4f}",
                   f"{parity['answer_tokens']} answer tokens of {held}"),
            Figure("Identical greedy continuations", _percent(parity["identical_greedy"]), f"of {parity['prompts']} prompts"),
            Figure("Top-1 agreement / mean KL (nats) over whole conversations",
                   f"{parity['top1_agreement']:.4f} / {parity['mean_kl']:.4f}", f"{parity['tokens']} tokens, most of them the user's text"),
        ]
    task = report.get("task")
    if task:
        rows.append(Figure("Adapter task success", f"{_percent(task['bf16_success'])} BF16 merged -> "
                           f"{_percent(task['quantized_success'])} {_format(report)}", f"{task['prompts']} prompts"))
    retention = report.get("retention")
    if retention:
        rows.append(Figure("Adapter change retained", _percent(retention["pooled"]),
                           f"median tensor {_percent(retention['median'])}, worst {_percent(retention['minimum'])}"))
    if "reload_max_logit_diff" in report:
        rows.append(Figure("Independent reload, max logit difference", f"{report['reload_max_logit_diff']:.2e}",
                           "the checkpoint read back by fp4prep's own reader vs the calibrated model"))
    for served in report.get("serving") or []:
        p = served["parity"]
        rows.append(Figure(f"Served on {_hardware(served)}: top-1 / KL on assistant turns",
                           f"{p['answer_top1']:.4f} / {p['answer_kl']:.4f}", _serving_summary(served)))
    return rows + _run_figures(report)


def _run_figures(report: dict[str, Any]) -> list[Figure]:
    rows: list[Figure] = []
    if report.get("bf16_bytes") and report.get("output_bytes"):
        bf16, out = report["bf16_bytes"], report["output_bytes"]
        rows.append(Figure("Checkpoint size", _size(out), f"{out / bf16:.2f}x the BF16 merged model's {_size(bf16)}"))
    experts = report.get("expert_tokens")
    if experts:
        least = min(min(v) for v in experts.values())
        rows.append(Figure("MoE experts", "every expert calibrated", f"the fewest tokens one expert got: {least}"))
    rounding = report.get("expert_gptq")
    if rounding:
        done, kept = sum(v[0] for v in rounding.values()), sum(v[1] for v in rounding.values())
        rows.append(Figure(
            "Routed experts rounded by GPTQ", f"{done} of {done + kept} expert projections",
            "every one" if not kept else
            f"{kept} kept max calibration (fewer tokens reached them than their input width): "
            + ", ".join(f"{layer} {v[1]}" for layer, v in rounding.items() if v[1]),
        ))
    seconds = report.get("stage_seconds") or {}
    if seconds:
        rows.append(Figure("Pipeline time", f"{sum(seconds.values()):.1f} s",
                           ", ".join(f"{stage} {s:.1f} s" for stage, s in seconds.items())))
    if report.get("device"):
        resumed = report.get("resumed_from_layer")
        rows.append(Figure("Computed on", report["device"],
                           f"resumed after {resumed} calibrated layers of an earlier run" if resumed else "one layer at a time"))
    return rows


def chart(report: dict[str, Any]) -> list[Bar]:
    """BF16 merged model vs the checkpoint, metric by metric (the BF16 model is the reference for
    agreement figures, so it scores 100% there by definition)."""
    bars: list[Bar] = []
    task = report.get("task")
    if task:
        bars.append(Bar("Adapter task success", task["bf16_success"], task["quantized_success"],
                        _percent(task["bf16_success"]), _percent(task["quantized_success"]), 1.0))
    parity = report.get("parity")
    if parity:
        for label, key in (("Greedy continuation identical", "identical_greedy"),
                           ("Top-1 agreement on BF16's own answers", "continuation_top1"),
                           ("Top-1 agreement on assistant turns", "answer_top1")):
            bars.append(Bar(label, 1.0, parity[key], "100% (reference)", _percent(parity[key]), 1.0))
    if report.get("bf16_bytes") and report.get("output_bytes"):
        bf16, fp4 = float(report["bf16_bytes"]), float(report["output_bytes"])
        bars.append(Bar("Checkpoint size", bf16, fp4, _size(bf16), _size(fp4), max(bf16, fp4)))
    return bars


def text(rows: list[Figure], indent: str = "  ") -> list[str]:
    """Figures as terminal lines."""
    width = max((len(r.label) for r in rows), default=0)
    return [f"{indent}{r.label:<{width}}  {r.value}" + (f"  ({r.hint})" if r.hint else "") for r in rows]


def markdown(rows: list[Figure]) -> list[str]:
    """Figures as a Markdown table."""
    return ["| | | |", "|---|---|---|", *(f"| {r.label} | {r.value} | {r.hint} |" for r in rows)]
