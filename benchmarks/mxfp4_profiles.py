"""Benchmark: an MXFP4 checkpoint on Hopper and on Blackwell, and whether calibrating for Blackwell helps.

vLLM 0.33 runs an MXFP4 checkpoint weights-only on Hopper (Marlin) and W4A4 on Blackwell
(FlashInfer quantizes each layer's input to MXFP4; ``formats/engine.mxfp4_activations``). This runs
the demo's MXFP4 job once per candidate calibration and measures each checkpoint both ways against
the same BF16 side: parity on the held-back conversations and the adapter's task.

Candidates: the shipped recipe (GPTQ with the BF16 inputs Hopper multiplies by), and recipes that
calibrate with the inputs quantized as on Blackwell (``Recipe.calibrate_for``: the AWQ search's
scores and GPTQ's Hessians then see MXFP4 inputs); every checkpoint declares weights-only MXFP4.

    .venv/bin/python benchmarks/mxfp4_profiles.py [--task sentiment|orders] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def candidates() -> dict[str, Any]:
    from fp4prep.pipeline.recipes import RECIPES, AwqSearch, Gptq
    from fp4prep.pipeline.serving import MXFP4_W4A4

    shipped = RECIPES["mxfp4"]
    blackwell = {"calibrate_for": MXFP4_W4A4.key}
    return {
        "shipped: GPTQ on BF16 inputs": shipped,
        "GPTQ on MXFP4 inputs": dataclasses.replace(shipped, **blackwell),
        "AWQ search (alpha step 0.5) + GPTQ on MXFP4 inputs": dataclasses.replace(
            shipped, steps=(AwqSearch(alpha_step=0.5), Gptq(hessian_stride=2)), **blackwell
        ),
    }


def measure(task: str) -> list[dict[str, Any]]:

    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, Thresholds, device, run
    from fp4prep.pipeline.serving import MXFP4_W4A4
    from fp4prep.pipeline.stages import parity_reference
    from fp4prep.pipeline.validation import parity, reader

    assets = demo.build(task=demo.TASKS[task])
    anything = Thresholds(continuation_top1=0, answer_kl=1e9, identical_greedy=0, adapter_retention=-1e9,
                          reload_max_logit_diff=1e9)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4prep-mxfp4-") as tmp:
        config = PipelineConfig(base_dir=assets.base_dir, output_dir=Path(tmp) / "unused", adapter_dir=assets.adapter_dir,
                                calibration_file=assets.calibration_file, quantization="mxfp4", device="cpu")
        reference = parity_reference(config)
        assert reference.task is not None, "the demo adapter carries its evaluation prompts"
        bf16_task, prompts = reference.task_success, len(reference.task.prompts)
        compute = device.resolve("cpu")
        for i, (name, recipe) in enumerate(candidates().items()):
            out = Path(tmp) / f"c{i}"
            started = time.perf_counter()
            result = run(dataclasses.replace(config, output_dir=out, recipe=recipe, thresholds=anything, quality_gate=False))
            seconds = time.perf_counter() - started
            for profile, model in (
                ("Hopper (inputs BF16)", reader.load(out, compute, quantize_activations=False)),
                ("Blackwell (W4A4)", reader.load(out, compute, numerics=MXFP4_W4A4.key)),
            ):
                measured = parity.compare(reference, model)
                p, score = measured.parity, measured.task_success
                rows.append({
                    "task": task, "recipe": name, "served on": profile, "answer_top1": p.answer_top1,
                    "answer_kl": p.answer_kl, "continuation_top1": p.continuation_top1,
                    "identical_greedy": p.identical_greedy, "task_bf16": bf16_task, "task_mxfp4": score,
                    "task_prompts": prompts, "calibration_s": result.stage_seconds.get("calibrating", 0.0),
                    "run_s": seconds,
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="sentiment", choices=("sentiment", "orders"))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = measure(args.task)
    print("| recipe | served on | top-1 / KL on answers | top-1 on BF16's continuations | identical greedy | task | calibration |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['served on']} | {r['answer_top1']:.3f} / {r['answer_kl']:.3f} | "
              f"{r['continuation_top1']:.3f} | {r['identical_greedy']:.0%} | {r['task_bf16']:.0%} -> {r['task_mxfp4']:.0%} | "
              f"{r['calibration_s']:.0f} s |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
