"""Benchmark: preparing a base that ships only in FP4, on the demo bases' MXFP4 releases.

An adapter trained on an FP4 release learned on the release's dequantized weights, which sit on the
FP4 grid; its change is mostly smaller than half a step. Each row prepares the adapter in the
release's format and measures the result against the BF16 merged model (the release dequantized,
plus the adapter), on the demo's held-back conversations and the adapter's task prompts:

- ``peers``: the peers' way: PEFT's merge into the dequantized release, then every weight
  requantized from scratch with ModelOpt's default for the format (max calibration);
- ``scratch``: fp4prep's own MXFP4 recipe (GPTQ) on the same merged BF16 weights, every weight
  requantized from scratch, as a job on a BF16 base does;
- ``held-rtn``: the release's block scales held, the changed weights rounded to nearest on them,
  every other tensor copied from the release byte for byte;
- ``held-gptq``: the same, the changed weights rounded by GPTQ on the Hessians of the BF16 merged
  model's inputs, without the coordinate descent after it;
- ``merged-inputs``: GPTQ and coordinate descent on the held scales, every layer rounded on the
  BF16 merged model's inputs (the recipe before it rounded on the prepared model's);
- ``stored-order``: the recipe with GPTQ rounding the columns in their stored order;
- ``recipe``: what a job does: GPTQ on the held scales in activation order, then coordinate descent over every column,
  each layer rounded on the inputs the layers before it give once rounded, towards the BF16 merged
  model's outputs.

    .venv/bin/python benchmarks/fp4_release.py [--base dense moe] [--task sentiment dates] [--only peers held-rtn]
        [--parity-prompts 60]

The releases and adapters are built on first use (``fp4prep.demo.release``: the adapter is trained on
the release, which takes minutes). For the MoE release the peers' row also quantizes attention, which
the release keeps in BF16: fp4prep's export quantizes every linear layer. "base read" is how many
times over the job read its base, in the base's stored bytes (FP4 for a release).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DESCENT_PASSES = 4  # the job's (held_gptq.DESCENT_PASSES)
CANDIDATES = ("peers", "scratch", "held-rtn", "held-gptq", "merged-inputs", "stored-order", "recipe")


def run_candidate(candidate: str, assets: Any, out: Path, parity_prompts: int = 60) -> dict[str, Any]:
    from fp4prep.pipeline import PipelineConfig, run
    from fp4prep.pipeline.algorithms import held_gptq
    from fp4prep.pipeline.recipes import recipe_for

    recipe = recipe_for("mxfp4")
    base = assets.dequantized_dir if candidate in ("peers", "scratch") else assets.release_dir
    if candidate in ("peers", "held-rtn"):
        recipe = dataclasses.replace(recipe, steps=())
    held_gptq.DESCENT_PASSES = 0 if candidate == "held-gptq" else DESCENT_PASSES
    held_gptq.PREPARED_INPUTS = candidate in ("stored-order", "recipe")
    held_gptq.ACTIVATION_ORDER = candidate != "stored-order"
    started = time.perf_counter()
    result = run(PipelineConfig(
        base_dir=base, output_dir=out, quantization="mxfp4", adapter_dir=assets.adapter_dir,
        calibration_file=assets.calibration_file, recipe=recipe, quality_gate=False,
        calibration_tokens=8192, user_token_minimum=4096, parity_prompts=parity_prompts,
    ))
    p = result.parity
    return {
        "candidate": candidate,
        "retained": result.retention.pooled if result.retention else None,
        "answer_kl": p.answer_kl,
        "answer_top1": p.answer_top1,
        "continuation_top1": p.continuation_top1,
        "identical_greedy": p.identical_greedy,
        "bf16_task": result.task.bf16_success if result.task else None,
        "task": result.task.quantized_success if result.task else None,
        "release": result.release,
        "kept_in_outputs": (result.release or {}).get("kept_in_outputs"),
        "base_passes": result.reads["base"]["total_passes"] if result.reads else None,
        "base_passes_by_stage": result.reads["base"]["passes"] if result.reads else None,
        "seconds": time.perf_counter() - started,
        "device": result.device,
    }


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def main() -> None:
    from fp4prep.demo import release
    from fp4prep.demo.tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--task", nargs="+", choices=sorted(TASKS), default=["sentiment", "dates"])
    parser.add_argument("--only", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--parity-prompts", type=int, default=60,
                        help="held-back conversations measured (a job's default is 16; 60 is every one the demo holds back)")
    args = parser.parse_args()
    rows = []
    print("| base | adapter | candidate | change retained | kept in outputs | KL on answers | top-1 on continuations | identical greedy | task (BF16) | copied / requantized | base read | time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for base in args.base:
        for task in args.task:
            assets = release.build(base, TASKS[task])
            for candidate in args.only:
                with tempfile.TemporaryDirectory(prefix="fp4prep-release-") as tmp:
                    row = {"base": base, "adapter": task, **run_candidate(candidate, assets, Path(tmp) / "out", args.parity_prompts)}
                rows.append(row)
                kept = row["release"]
                copies = f"{kept['copied']} / {kept['requantized']}" if kept else "all requantized"
                print(
                    f"| {base} | {task} | {candidate} | {row['retained']:.3f} | {_share(row['kept_in_outputs'])} | {row['answer_kl']:.4f} | "
                    f"{row['continuation_top1']:.3f} | {row['identical_greedy']:.2f} | {row['task']:.0%} ({row['bf16_task']:.0%}) | "
                    f"{copies} | {row['base_passes']:.2f}x | {row['seconds']:.0f} s |",
                    flush=True,
                )
    print(json.dumps(rows, default=str))


if __name__ == "__main__":
    main()
