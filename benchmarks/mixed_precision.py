"""Benchmark: does keeping the projections FP4 hurts most in FP8 buy back what the recipe loses?

On one demo adapter (default: ``dates``, ISO dates from dates in words, an adapter neither recipe
was tuned on), per candidate, in its own process: the demo base and adapter merged, calibrated
layer by layer, and the calibrated (fake-quantized) model measured against the BF16 merged model
as a job's validation measures a checkpoint: KL and top-1 on the assistant turns, top-1 on the BF16
model's continuations, identical greedy, the adapter's task. The candidates:

- ModelOpt's max calibration (the default the peers run) and fp4prep's NVFP4 recipe;
- the recipe with the groups of projections whose GPTQ rounding moved their outputs most (relative
  output error, ``fp4prep/pipeline/algorithms/mixed.py``, from the recipe's own run) kept in FP8
  (E4M3 weights per output channel, inputs per token), within each budget (a share of the
  quantized weights);
- the recipe with whole decoder layers in FP8, those whose quantization added most to the residual
  stream (``|out_q - out|² / |out|²`` on the layer's calibration inputs, measured after its steps);
- as a control for each, the same number of weights kept in FP8 where the error was smallest, so
  that what the ranking buys is told apart from what any FP8 buys.

The model measured is the calibrated one, not a reloaded export: the pipeline's reload check holds
those within 1e-3 in logits for a plain NVFP4 checkpoint.

    .venv/bin/python benchmarks/mixed_precision.py [--task dates|sentiment|orders] [--base dense|moe]
                                                   [--budgets 0.05 0.1] [--rank layers groups] [--json out.json]
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

CHILD = """
import dataclasses, json, sys, time
from pathlib import Path
from fp4prep import demo
from fp4prep.pipeline import PipelineConfig, recipes, stages
from fp4prep.pipeline.validation import stage
from fp4prep.pipeline import device as device_mod
from fp4prep.pipeline.model import streaming
from fp4prep.pipeline.model.merge import MergedWeights
from fp4prep.pipeline.model.safetensors import read_config
from fp4prep.pipeline.modelopt_ext.session import Session
from fp4prep.pipeline.model.reads import ReadTally
from fp4prep.pipeline.progress import Progress
from fp4prep.pipeline.workdir import opened
from fp4prep.pipeline.algorithms.layer_pass import LayerPass
kind, fp8, task, out, prompts, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
if base == "moe":
    from fp4prep.demo import moe as builder
else:
    builder = demo
assets = builder.build(task=demo.TASKS[task])
recipe = recipes.RECIPES["nvfp4"]
recipe = dataclasses.replace(recipe, steps=()) if kind == "default" else dataclasses.replace(recipe, fp8_modules=tuple(fp8))
config = PipelineConfig(base_dir=assets.base_dir, output_dir=out, quantization="nvfp4", adapter_dir=assets.adapter_dir,
                        calibration_file=assets.calibration_file, recipe=recipe, quality_gate=False, parity_prompts=prompts)
compute = device_mod.resolve(config.device)
LayerPass.measure_layers = kind == "recipe" and not fp8  # the first run: what each layer adds to the residual
out.parent.mkdir(parents=True, exist_ok=True)
with opened(None, out) as work, Session(compute) as session:
    state = stages.Run(config, recipe, Progress(), work, compute, session, ReadTally({}, lambda: ""))
    merged = stages._merge(state)
    started = time.perf_counter()
    calibrated, calibration = stages._calibrate(state, merged)
    calibrating = time.perf_counter() - started
    stages._quantize(state, calibrated, calibration)
    weights = MergedWeights(merged.base.source, merged.base.adapter, compute.dtype, compute.device)
    bf16_model = streaming.build(read_config(config.base_dir), weights, compute, config.base_dir)
    bf16 = stage.bf16_side(config, merged.base, calibration, bf16_model, lambda f: None)
    _, (behaviour, scored) = stage.measure(bf16, calibrated.model, lambda f: None)
print(json.dumps({"parity": dataclasses.asdict(behaviour), "task": dataclasses.asdict(scored) if scored else None,
                  "calibrating_s": calibrating, "errors": [g.to_list() for g in calibration.learned.rounding_errors],
                  "layer_errors": calibration.learned.layer_errors,
                  "device": compute.describe()}))
"""


def run_candidate(kind: str, fp8: list[str], task: str, prompts: int, base: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fp4prep-mixed-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, kind, json.dumps(fp8), task, str(Path(tmp) / "out"), str(prompts), base],
            cwd=ROOT, capture_output=True, text=True,
        )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(name: str, result: dict[str, Any], fp8_weights: int, total: int) -> dict[str, Any]:
    parity, scored = result["parity"], result["task"] or {}
    share = fp8_weights / total if total else 0.0
    return {
        "candidate": name,
        "fp8_share": share,
        # NVFP4 stores 4.5 bits a weight (a 1-byte scale per 16), FP8 8 (and one scale per row).
        "weight_bytes_vs_nvfp4": (4.5 * (1 - share) + 8 * share) / 4.5,
        "answer_kl": parity["answer_kl"],
        "answer_top1": parity["answer_top1"],
        "continuation_top1": parity["continuation_top1"],
        "identical_greedy": parity["identical_greedy"],
        "whole_kl": parity["mean_kl"],
        "bf16_success": scored.get("bf16_success"),
        "success": scored.get("quantized_success"),
        "calibrating_s": result["calibrating_s"],
    }


def main() -> None:
    from fp4prep.pipeline.algorithms.mixed import GroupError, select

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="dates", choices=["dates", "sentiment", "orders"])
    parser.add_argument("--base", default="dense", choices=["dense", "moe"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--parity-prompts", type=int, default=60)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank", nargs="+", choices=["layers", "groups"], default=["layers", "groups"],
                        help="what is kept in FP8: whole decoder layers, fused groups of projections, or both")
    args = parser.parse_args()

    def least_hurt_first(ranked: list[GroupError]) -> list[GroupError]:
        """The control: the same rows, ranked the other way round (1 - relative error)."""
        return [GroupError(g.names, g.reference - g.error, g.reference, g.weights) for g in ranked]

    def measure(name: str, kind: str, chosen: list[GroupError], total: int) -> dict[str, Any]:
        before = time.perf_counter()
        result = run_candidate(kind, [n for g in chosen for n in g.names], args.task, args.parity_prompts, args.base)
        r = row(name, result, sum(g.weights for g in chosen), total)
        r["wall_s"] = time.perf_counter() - before
        r["fp8_modules"] = [n for g in chosen for n in g.names]
        print(json.dumps(r), flush=True)
        return {**r, "_result": result}

    rows = [measure("max (default)", "default", [], 0)]
    recipe = measure("the recipe", "recipe", [], 0)
    rows.append(recipe)
    groups = [GroupError.from_list(g) for g in recipe["_result"]["errors"]]
    total = sum(g.weights for g in groups)
    print(f"{len(groups)} groups, {total} weights; on {recipe['_result']['device']}", flush=True)
    for g in sorted(groups, key=lambda g: g.relative, reverse=True)[:12]:
        print(f"  {g.relative:.4f}  {g.weights:>9}  {', '.join(g.names)}", flush=True)
    layers = []
    for prefix, (error, reference, weights) in recipe["_result"]["layer_errors"].items():
        names = tuple(n for g in groups for n in g.names if n.startswith(prefix))
        layers.append(GroupError(names, error, reference, int(weights)))
    for g in sorted(layers, key=lambda g: g.relative, reverse=True):
        print(f"  layer {g.names[0].rsplit('.', 2)[0].split('layers.')[-1]:>3}: {g.relative:.5f}", flush=True)
    for budget in args.budgets if "layers" in args.rank else []:
        worst = select(layers, budget, total)
        rows.append(measure(f"the recipe, worst layers' {budget:.0%} in FP8", "recipe", worst, total))
        best = select(least_hurt_first(layers), budget, total)
        rows.append(measure(f"the recipe, least-hurt layers' {budget:.0%} in FP8 (control)", "recipe", best, total))
    for budget in args.budgets if "groups" in args.rank else []:
        worst = select(groups, budget, total)
        rows.append(measure(f"the recipe, worst {budget:.0%} in FP8", "recipe", worst, total))
        best = select(least_hurt_first(groups), budget, total)
        rows.append(measure(f"the recipe, least-hurt {budget:.0%} in FP8 (control)", "recipe", best, total))
    for r in rows:
        r.pop("_result", None)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    default = rows[0]
    print("\n| candidate | weights in FP8 | weight bytes (× NVFP4) | KL on answers (× default) | top-1 on answers "
          "| top-1 on BF16's continuations | identical greedy | KL whole conversations | task: BF16 → FP4 | calibrating |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        task = f"{r['bf16_success']:.0%} → {r['success']:.0%}" if r["success"] is not None else "n/a"
        print(f"| {r['candidate']} | {r['fp8_share']:.1%} | {r['weight_bytes_vs_nvfp4']:.3f} | "
              f"{r['answer_kl']:.4f} ({r['answer_kl'] / default['answer_kl']:.2f}×) | {r['answer_top1']:.3f} | "
              f"{r['continuation_top1']:.3f} | {r['identical_greedy']:.2f} | {r['whole_kl']:.3f} | {task} | "
              f"{r['calibrating_s']:.0f} s |")


if __name__ == "__main__":
    main()
