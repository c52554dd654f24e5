"""The one rendering of a run's report: the command, the model card, the pages and the demo all show
the same figures in the same words."""

from __future__ import annotations

from typing import Any

from fp4prep.pipeline.validation import report

REPORT: dict[str, Any] = {
    "quantization": "nvfp4",
    "parity": {
        "prompts": 16, "tokens": 919, "top1_agreement": 0.6594, "mean_kl": 0.6005, "identical_greedy": 1.0,
        "answer_tokens": 138, "answer_top1": 0.942, "answer_kl": 0.0682,
        "continuation_tokens": 80, "continuation_top1": 1.0, "continuation_kl": 0.0097,
    },
    "task": {"prompts": 50, "bf16_success": 1.0, "quantized_success": 0.98},
    "retention": {"pooled": 0.999, "minimum": 0.97, "median": 0.998},
    "reload_max_logit_diff": 0.0,
    "bf16_bytes": 269_000_000,
    "output_bytes": 121_000_000,
    "stage_seconds": {"merging": 2.0, "calibrating": 50.0},
    "device": "cpu, bfloat16",
    "expert_tokens": {},
}


def test_the_headline_says_whether_the_adapter_survived() -> None:
    assert report.headline(REPORT) == [
        "on answers: top-1 0.942, KL 0.0682; top-1 on the BF16 model's continuations 1.000; identical greedy 1.00 "
        "(16 held-back prompts)",
        "adapter task: 100% (BF16 merged) -> 98% (NVFP4, 50 prompts)",
    ]


def test_every_figure_is_labelled_and_shown_alike_as_text_and_as_markdown() -> None:
    rows = report.figures(REPORT)
    labels = [r.label for r in rows]
    assert labels[:3] == [
        "Top-1 agreement on the BF16 model's continuations",
        "Top-1 agreement / mean KL (nats) on assistant turns",
        "Identical greedy continuations",
    ]
    assert "Adapter task success" in labels and "Checkpoint size" in labels and "Computed on" in labels
    text, table = report.text(rows), report.markdown(rows)
    assert len(text) == len(rows) and len(table) == len(rows) + 2
    for row, line, cell in zip(rows, text, table[2:], strict=True):
        assert row.value in line and f"| {row.label} | {row.value} |" in cell
    assert "0.9420 / 0.0682" in text[1] and "(138 answer tokens of 16 held-back conversations)" in text[1]


def test_the_chart_compares_bf16_and_the_checkpoint_and_a_report_without_figures_shows_none() -> None:
    bars = {b.label: b for b in report.chart(REPORT)}
    assert bars["Adapter task success"].fp4_width == 98.0 and bars["Adapter task success"].bf16_width == 100.0
    assert bars["Checkpoint size"].fp4_width == round(100 * 121 / 269, 1)
    assert report.figures({}) == [] and report.chart({}) == [] and report.headline({}) == []


def test_the_routed_experts_rounding_is_counted_and_the_layers_that_kept_max_calibration_named() -> None:
    moe = {
        **REPORT,
        "expert_tokens": {"model.layers.1.mlp": [300, 12, 90, 410]},
        "expert_gptq": {"model.layers.1.mlp.experts": [6, 2], "model.layers.2.mlp.experts": [8, 0]},
    }
    rows = {r.label: r for r in report.figures(moe)}
    assert rows["MoE experts"].hint == "the fewest tokens one expert got: 12"
    rounded = rows["Routed experts rounded by GPTQ"]
    assert rounded.value == "14 of 16 expert projections"
    assert rounded.hint == (
        "2 kept max calibration (fewer tokens reached them than their input width): model.layers.1.mlp.experts 2"
    )
    everything = {**moe, "expert_gptq": {"model.layers.2.mlp.experts": [8, 0]}}
    assert {r.label: r for r in report.figures(everything)}["Routed experts rounded by GPTQ"].hint == "every one"
    assert "Routed experts rounded by GPTQ" not in {r.label for r in report.figures(REPORT)}
