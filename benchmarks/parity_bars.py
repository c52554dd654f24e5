"""Where the SmolLM2 parity bars belong: sound NVFP4 checkpoints against damaged ones, per adapter.

For each demo adapter, the format's recipe runs through the pipeline (quality gate off), then the
checkpoint is damaged in copies and each copy's parity with the BF16 merged model is measured on
the run's own held-back examples:

- "adapter lost": the base alone through the same recipe (a sound checkpoint of the wrong model);
- "layer N down_proj scrambled": one decoder layer's MLP output projection with its FP4 rows
  reversed (its scales and codes kept, so the structure checks still pass).

The catalogue's SmolLM2 thresholds must sit between the sound rows and every damaged one. Each
row also shows the identical-greedy share and the task score as decoding the checkpoint gives them
(validation computes both teacher-forced: the columns must agree), and the gate's verdict were the
BF16 model's continuations cut to the first k tokens (``--shorter``).

    .venv/bin/python benchmarks/parity_bars.py [--task sentiment] [--layers 0 12 29] [--shorter 4 8]
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

from registry.catalogue import CATALOGUE  # noqa: E402

TASKS = ("sentiment", "orders")
FIGURES = ("continuation_top1", "answer_kl", "identical_greedy", "identical_greedy_decoded", "task_success",
           "task_decoded", "answer_top1", "mean_kl")


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


def decoded(reference: Any, model: Any, tokenizer: Any) -> dict[str, float]:
    """The identical-greedy share and the task score as decoding ``model`` gives them (how validation
    measured them before both were computed teacher-forced), for comparison."""
    from fp4prep.pipeline.validation import decoding

    got = decoding.greedy(model, reference.prompts, reference.continuation_tokens)
    identical = sum(a == b for a, b in zip(got, reference.expected, strict=True)) / len(got)
    task = reference.task
    lengths = [len(a) + 2 for a in task.answers]
    answers = decoding.greedy(model, task.prompts, max(lengths))
    hits = sum(
        tokenizer.decode(row[:n], skip_special_tokens=True).strip() == tokenizer.decode(a).strip()
        for row, n, a in zip(answers, lengths, task.answers, strict=True)
    )
    return {"identical_greedy_decoded": identical, "task_decoded": hits / len(answers)}


def measure(task: str, layers: list[int], quantization: str, shorter: list[int]) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, Thresholds, device, run
    from fp4prep.pipeline.stages import parity_reference
    from fp4prep.pipeline.validation import gate, parity, reader

    assets = demo.build(task=demo.TASKS[task])
    tokenizer = AutoTokenizer.from_pretrained(assets.base_dir)
    anything = Thresholds(continuation_top1=0, answer_kl=1e9, identical_greedy=0, adapter_retention=-1e9,
                          reload_max_logit_diff=1e9)
    common = {"base_dir": assets.base_dir, "calibration_file": assets.calibration_file, "quantization": quantization,
              "thresholds": anything, "quality_gate": False}
    bars = Thresholds(**next(e for e in CATALOGUE if e["slug"] == "smollm2-135m-instruct")["run_settings"]["thresholds"])
    compute = device.resolve("auto")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4prep-bars-") as tmp:
        config = PipelineConfig(output_dir=Path(tmp) / "sound", adapter_dir=assets.adapter_dir, **common)
        sound = run(config)
        base_only = run(PipelineConfig(output_dir=Path(tmp) / "base-only", **common))
        # The BF16 merged model's side, once for every checkpoint; and with shorter continuations
        # (the first k tokens of the same greedy continuations), to see what fewer would decide.
        reference = parity_reference(config)
        shorter_refs = {k: parity.reference_of(reference.model, reference.examples, k, task=reference.task) for k in shorter}
        checkpoints = [("sound", sound.output_dir), ("adapter lost", base_only.output_dir)]
        checkpoints += [(f"layer {layer} down_proj scrambled", Path(tmp) / f"layer{layer}") for layer in layers]
        for name, directory in checkpoints:
            if not directory.exists():
                scramble(sound.output_dir, directory, int(name.split()[1]))
            model = reader.load(directory, compute)
            measured = parity.compare(reference, model)
            row = {"task": task, "checkpoint": name, **asdict(measured.parity), "task_success": measured.task_success,
                   "task_bf16": reference.task_success, **decoded(reference, model, tokenizer),
                   "passes": not gate.misses(bars, measured.parity, 0.0, None)}
            for k, ref in shorter_refs.items():
                row[f"passes_{k}_tokens"] = not gate.misses(bars, parity.compare(ref, model).parity, 0.0, None)
            rows.append(row)
            del model
            if name.startswith("layer"):
                shutil.rmtree(directory)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, action="append", help="adapters to run (default: both)")
    parser.add_argument("--layers", type=int, nargs="*", default=[0, 6, 12, 18, 24, 29])
    parser.add_argument("--quantization", default="nvfp4")
    parser.add_argument("--shorter", type=int, nargs="*", default=[4, 8],
                        help="also the gate's verdict with the first k continuation tokens only")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = [row for task in args.task or TASKS for row in measure(task, args.layers, args.quantization, args.shorter)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    verdicts = ["passes"] + [f"passes_{k}_tokens" for k in args.shorter]
    print(f"\n| adapter | checkpoint | {' | '.join(FIGURES + tuple(verdicts))} |")
    print("|---|---|" + "---:|" * (len(FIGURES) + len(verdicts)))
    for row in rows:
        figures = [f"{row[f]:.3f}" for f in FIGURES] + ["pass" if row[v] else "fail" for v in verdicts]
        print(f"| {row['task']} | {row['checkpoint']} | " + " | ".join(figures) + " |")


if __name__ == "__main__":
    main()
