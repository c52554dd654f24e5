"""Benchmark: which quantization recipe keeps an adapter's skill best, at what cost.

Runs the real pipeline (merge, layerwise calibration, export, independent reload, parity) once per
candidate recipe and adapter, each in its own process, on the demo base (SmolLM2-135M-Instruct)
with three adapters of different kinds: the demo's sentiment labels, strict JSON extraction of an
order, and ISO dates from dates in words (``dates``, added after the recipes were chosen: an adapter
they were not tuned on). Prints one table: per candidate, parity where the model answers (KL and top-1 on the
assistant turns, top-1 on the BF16 model's own greedy continuations, identical greedy), the
adapter's task success on the checkpoint against BF16, calibration time against the format's
default recipe, and peak memory.

The candidates are the recipes fp4prep can run: ModelOpt's max calibration of the format's preset
(the default the peers run), fp4prep's AWQ search with its scales folded away, GPTQ, and both, with
their settings varied. Candidates measured earlier and dropped (ModelOpt's AWQ-lite, MSE, local-
Hessian and 4-over-6 weight scales, its own GPTQ, a weights-only diagnostic) are in RESULTS.md.

    .venv/bin/python benchmarks/recipe_search.py [--base dense|moe] [--format nvfp4|mxfp4|all] [--only NAME ...] [--json out.json]

``--base moe`` runs the same candidates on the mixture-of-experts demo (``fp4prep.demo.moe``: the demo
base upcycled into a Mixtral MoE, adapters trained on it with LoRA on the fused expert tensors), and
adds how many routed-expert projections GPTQ rounded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (format, the recipe's steps: [(step class name, its fields)]). A recipe with no steps is
# ModelOpt's own max calibration of the format's preset: what the peers run by hand. "(default)"
# rows are the baseline each format's KL and calibration time are compared with.
AWQ = "AwqSearch"
GPTQ = "Gptq"
CANDIDATES: dict[str, tuple[str, list[tuple[str, dict[str, Any]]]]] = {
    "nvfp4 max (default)": ("nvfp4", []),
    # fp4prep's AWQ search (fp4prep/pipeline/algorithms/awq.py): one scale per fold group, scored with
    # weights and activations quantized as the engine runs them, no scale where none is better;
    # candidates scored on 2048 evenly spread calibration tokens unless said otherwise.
    "nvfp4 AWQ search (alpha step 0.25)": ("nvfp4", [(AWQ, {"alpha_step": 0.25})]),
    "nvfp4 AWQ search (alpha step 0.5)": ("nvfp4", [(AWQ, {"alpha_step": 0.5})]),
    "nvfp4 GPTQ alone (Hessians from every 2nd token)": ("nvfp4", [(GPTQ, {"hessian_stride": 2})]),
    # The AWQ search, then GPTQ on the folded weights against static scales (algorithms/gptq.py).
    "nvfp4 AWQ (alpha step 0.5) + GPTQ (Hessians from every 2nd token)": (
        "nvfp4", [(AWQ, {"alpha_step": 0.5}), (GPTQ, {"hessian_stride": 2})]),
    "nvfp4 AWQ (alpha step 0.5) + GPTQ (Hessians from every 2nd token, activation order): the recipe": (
        "nvfp4", [(AWQ, {"alpha_step": 0.5}), (GPTQ, {"hessian_stride": 2, "activation_order": True})]),
    # The recipe with the search on routed experts too (expert_awq.py; the recipe leaves them at 1).
    "nvfp4 AWQ (alpha step 0.5, routed experts searched too) + GPTQ (Hessians from every 2nd token)": (
        "nvfp4", [(AWQ, {"alpha_step": 0.5, "routed_experts": True}), (GPTQ, {"hessian_stride": 2})]),
    "nvfp4 AWQ (alpha step 1.0) + GPTQ (Hessians from every 2nd token)": (
        "nvfp4", [(AWQ, {"alpha_step": 1.0}), (GPTQ, {"hessian_stride": 2})]),
    "nvfp4 AWQ (alpha step 0.5, 1024 tokens scored) + GPTQ (Hessians from every 2nd token)": (
        "nvfp4", [(AWQ, {"alpha_step": 0.5, "scored_tokens": 1024}), (GPTQ, {"hessian_stride": 2})]),
    "nvfp4 AWQ (alpha step 0.25) + GPTQ (Hessians from every token)": (
        "nvfp4", [(AWQ, {"alpha_step": 0.25}), (GPTQ, {"hessian_stride": 1})]),
    "mxfp4 max (default)": ("mxfp4", []),
    "mxfp4 AWQ search (alpha step 0.25)": ("mxfp4", [(AWQ, {"alpha_step": 0.25})]),
    # MXFP4's scales are each block's own power of two, which GPTQ's rounding keeps (gptq.py).
    "mxfp4 GPTQ (Hessians from every 2nd token)": ("mxfp4", [(GPTQ, {"hessian_stride": 2})]),
    "mxfp4 GPTQ (Hessians from every 2nd token, activation order): the recipe": (
        "mxfp4", [(GPTQ, {"hessian_stride": 2, "activation_order": True})]),
    "mxfp4 AWQ (alpha step 0.5) + GPTQ (Hessians from every 2nd token)": (
        "mxfp4", [(AWQ, {"alpha_step": 0.5}), (GPTQ, {"hessian_stride": 2})]),
}
TASKS = ("sentiment", "orders", "dates")

CHILD = """
import dataclasses, json, sys, time
from pathlib import Path
from fp4prep import demo
from fp4prep.pipeline import PipelineConfig, Thresholds, run
from fp4prep.pipeline import recipes
fmt, steps, task, out, prompts, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
if base == "moe":
    from fp4prep.demo import moe as builder
else:
    builder = demo
assets = builder.build(task=demo.TASKS[task])
recipe = dataclasses.replace(recipes.RECIPES[fmt], steps=tuple(getattr(recipes, kind)(**fields) for kind, fields in steps))
# The CPU backend compiles its fused fake quantization once per process (per dtype and rank): done
# here, before the clock starts, so that no candidate's stage times carry it.
import torch
from fp4prep.pipeline.formats import numerics
for dtype in (torch.bfloat16, torch.float32):
    for shape in ((1024, 576), (2, 512, 576)):
        numerics.nvfp4_fake_quant(torch.randn(shape, dtype=dtype), 16, torch.tensor(3.0))
        numerics.mxfp4_fake_quant(torch.randn(shape, dtype=dtype), 32)
for dtype in (torch.bfloat16, torch.float32):
    numerics.static_nvfp4_fake_quant(torch.randn(1024, 576, dtype=dtype), torch.rand(1024 * 36), torch.tensor(3.0))
measure = Thresholds(continuation_top1=0, answer_kl=1e9, identical_greedy=0, adapter_retention=-1e9, reload_max_logit_diff=1e-3)
started = time.perf_counter()
result = run(PipelineConfig(base_dir=assets.base_dir, output_dir=out, quantization=fmt, adapter_dir=assets.adapter_dir,
                            calibration_file=assets.calibration_file, recipe=recipe, thresholds=measure, quality_gate=False,
                            parity_prompts=prompts))
import resource
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({**result.to_dict(), "wall": time.perf_counter() - started, "peak_rss": peak}, default=str))
"""


def run_candidate(name: str, task: str, parity_prompts: int, base: str = "dense") -> dict[str, Any]:
    fmt, steps = CANDIDATES[name]
    with tempfile.TemporaryDirectory(prefix="fp4prep-search-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, fmt, json.dumps(steps), task, str(Path(tmp) / "out"), str(parity_prompts), base],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        return {"candidate": name, "task": task, "failed": stderr.strip().splitlines()[-1][:300]}
    result = json.loads(stdout.strip().splitlines()[-1])
    parity, tasks = result["parity"], result.get("task") or {}
    return {
        "candidate": name,
        "task": task,
        "answer_kl": parity["answer_kl"],
        "answer_top1": parity["answer_top1"],
        "continuation_top1": parity["continuation_top1"],
        "identical_greedy": parity["identical_greedy"],
        "whole_kl": parity["mean_kl"],
        "answer_tokens": parity["answer_tokens"],
        "bf16_success": tasks.get("bf16_success"),
        "success": tasks.get("quantized_success"),
        "calibrating_s": result["stage_seconds"]["calibrating"],
        "quantizing_s": result["stage_seconds"]["quantizing"],
        "reload": result["reload_max_logit_diff"],
        "retention": (result.get("retention") or {}).get("pooled"),
        "peak_rss_mib": result["peak_rss"] / 2**20,
        # Routed-expert projections GPTQ rounded, of all (an MoE base; the rest kept max calibration).
        "experts_rounded": [sum(c[0] for c in result.get("expert_gptq", {}).values()),
                            sum(c[0] + c[1] for c in result.get("expert_gptq", {}).values())],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["nvfp4", "mxfp4", "all"], default="all")
    parser.add_argument("--only", nargs="*", help="candidate names (substrings) to run")
    parser.add_argument("--task", choices=TASKS, action="append", help="adapters to run (default: both)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--base", choices=["dense", "moe"], default="dense",
                        help="the demo base (SmolLM2-135M-Instruct) or its mixture-of-experts build "
                             "(fp4prep.demo.moe: Mixtral-style, 4 experts, top-2) with adapters trained on it")
    parser.add_argument("--parity-prompts", type=int, default=60,
                        help="held-back conversations parity is measured on (default: all 60 the demo holds back; "
                             "a job uses 16)")
    args = parser.parse_args()

    names = [n for n, (fmt, _) in CANDIDATES.items() if args.format in ("all", fmt)]
    if args.only:
        names = [n for n in names if any(o in n for o in args.only)]
    rows = []
    for task in args.task or TASKS:
        for name in names:
            before = time.perf_counter()
            row = run_candidate(name, task, args.parity_prompts, args.base)
            row["wall_s"] = time.perf_counter() - before
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    table(rows)


def table(rows: list[dict[str, Any]]) -> None:
    defaults = {(r["task"], r["candidate"].split()[0]): r for r in rows if "(default)" in r["candidate"] and "failed" not in r}
    experts = any(r.get("experts_rounded", [0, 0])[1] for r in rows)
    print("\n| adapter | candidate | KL on answers (× default) | top-1 on answers | top-1 on BF16's continuations | identical greedy "
          "| task: BF16 → FP4 | calibrating (× default) | peak RSS | reload |" + (" expert projections GPTQ-rounded |" if experts else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if experts else ""))
    for r in rows:
        if "failed" in r:
            print(f"| {r['task']} | {r['candidate']} | failed: {r['failed']} |||||||")
            continue
        base = defaults.get((r["task"], r["candidate"].split()[0]))
        ratio = f" ({r['calibrating_s'] / base['calibrating_s']:.1f}×)" if base else ""
        kl_ratio = f" ({r['answer_kl'] / base['answer_kl']:.2f}×)" if base else ""
        task = f"{r['bf16_success']:.0%} → {r['success']:.0%}" if r["success"] is not None else "n/a"
        name = f"**{r['candidate']}**" if r["candidate"].endswith("the recipe") else r["candidate"]
        print(f"| {r['task']} | {name} | {r['answer_kl']:.4f}{kl_ratio} | {r['answer_top1']:.3f} | {r['continuation_top1']:.3f} | "
              f"{r['identical_greedy']:.2f} | {task} | {r['calibrating_s']:.1f} s{ratio} | {r['peak_rss_mib']:.0f} MiB | {r['reload']:.1g} |"
              + (f" {r['experts_rounded'][0]} of {r['experts_rounded'][1]} |" if experts else ""))


if __name__ == "__main__":
    main()
