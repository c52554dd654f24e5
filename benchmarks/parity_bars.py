"""Where the SmolLM2 parity bars belong: sound NVFP4 checkpoints against damaged ones, per adapter.

For each demo adapter, the format's recipe runs through the pipeline (quality gate off), then the
checkpoint is damaged in copies and each copy's parity with the BF16 merged model is measured on
the run's own held-back examples:

- "adapter lost": the base alone through the same recipe (a sound checkpoint of the wrong model);
- "layer N down_proj scrambled": one decoder layer's MLP output projection with its FP4 rows
  reversed (its scales and codes kept, so the structure checks still pass).

The catalogue's SmolLM2 thresholds must sit between the sound rows and every damaged one.

    .venv/bin/python benchmarks/parity_bars.py [--task sentiment] [--layers 0 12 29]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASKS = ("sentiment", "orders")
FIGURES = ("continuation_top1", "answer_kl", "identical_greedy", "answer_top1", "mean_kl")


def scramble(checkpoint: Path, target: Path, layer: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, target)
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    for shard in target.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if name in tensors:
            tensors[name] = torch.flip(tensors[name], dims=[0]).contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return target
    raise SystemExit(f"{name} is not in {checkpoint}")


def measure(task: str, layers: list[int], quantization: str) -> list[dict[str, Any]]:
    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, Thresholds, run
    from fp4prep.pipeline.stages import parity_of, parity_reference

    assets = demo.build(task=demo.TASKS[task])
    anything = Thresholds(continuation_top1=0, answer_kl=1e9, identical_greedy=0, adapter_retention=-1e9,
                          reload_max_logit_diff=1e9)
    common = {"base_dir": assets.base_dir, "calibration_file": assets.calibration_file, "quantization": quantization,
              "thresholds": anything, "quality_gate": False}
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4prep-bars-") as tmp:
        config = PipelineConfig(output_dir=Path(tmp) / "sound", adapter_dir=assets.adapter_dir, **common)
        sound = run(config)
        rows.append({"task": task, "checkpoint": "sound", **asdict(sound.parity)})
        base_only = run(PipelineConfig(output_dir=Path(tmp) / "base-only", **common))
        reference = parity_reference(config)  # the BF16 merged model's side, once for every checkpoint
        rows.append({"task": task, "checkpoint": "adapter lost",
                     **asdict(parity_of(config, base_only.output_dir, reference))})
        for layer in layers:
            broken = scramble(sound.output_dir, Path(tmp) / f"layer{layer}", layer)
            rows.append({"task": task, "checkpoint": f"layer {layer} down_proj scrambled",
                         **asdict(parity_of(config, broken, reference))})
            shutil.rmtree(broken)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, action="append", help="adapters to run (default: both)")
    parser.add_argument("--layers", type=int, nargs="*", default=[0, 6, 12, 18, 24, 29])
    parser.add_argument("--quantization", default="nvfp4")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = [row for task in args.task or TASKS for row in measure(task, args.layers, args.quantization)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"\n| adapter | checkpoint | {' | '.join(FIGURES)} |")
    print("|---|---|" + "---:|" * len(FIGURES))
    for row in rows:
        print(f"| {row['task']} | {row['checkpoint']} | " + " | ".join(f"{row[f]:.3f}" for f in FIGURES) + " |")


if __name__ == "__main__":
    main()
