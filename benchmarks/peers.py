"""Benchmark: fp4prep's recipe against the open quantizers a user could pick instead, one evaluator.

For each demo base and adapter, the adapter is merged into the base by PEFT (what a user of any
quantizer holds), and each quantizer runs on that merged BF16 model with the calibration sequences
fp4prep's recipe calibrates on (the demo's conversations and general text, 16 × 512 tokens):

- ``modelopt``: ModelOpt's default for the format (its preset, max calibration), through fp4prep's
  pipeline with no recipe steps;
- ``llmc-rtn``, ``llmc-gptq``, ``llmc-awq-gptq``: llm-compressor's ``QuantizationModifier``,
  ``GPTQModifier``, and ``AWQModifier`` then ``GPTQModifier``, with the compressed-tensors preset of
  the format (``NVFP4``; ``MXFP4A16``, weights only, as fp4prep's MXFP4 is);
- ``autoround``, ``autoround-fast``: Intel's AutoRound (its default 200 iterations; 50);
- ``fp4prep``: the local command (``fp4prep quantize``) on the base and the adapter, as a user runs it;
  ``fp4prep-other-order``: the same job with the recipe's GPTQ in the other column order (activation
  order where the recipe keeps stored order, and back), to decide it on every adapter;
  ``fp4prep-nearest-exponents``: MXFP4 with GPTQ on compressed-tensors' block exponents (each block's
  largest value rounded to the nearest power of two); ``fp4prep-best-exponents``: of each block's
  two candidate powers, the one whose rounding moves the outputs less; ``fp4prep-every-token``: GPTQ's Hessians from
  every calibration token (the recipe takes every second); ``fp4prep-other-scales``: NVFP4's block
  scales the other way (``Gptq.nv_scales``: max calibration's where the recipe searches them on
  each block's outputs, and back).

Every export is then scored by the same code, fp4prep's reader (each weight dequantized as vLLM
dequantizes it, each quantized layer's input quantized as vLLM quantizes it for the format),
against the PEFT-merged BF16 model on the held-back conversations and the adapter's task: KL and
top-1 on answers, top-1 on the BF16 model's continuations, identical greedy, task, and the share of
the adapter's change retained in the weights; with each quantizer's wall time and peak memory
(its whole process: load, calibrate, quantize, save; one at a time).

Each peer loads and calibrates the model in the dtype fp4prep computes in on this CPU (BF16, or FP32
where the CPU has no native BF16 arithmetic). Each peer runs in its own virtual environment under ``$FP4PREP_DATA_DIR/peers`` (pinned, torch 2.13.0
kept by a constraints file; made on first use), through ``peer_quantize.py``.

    .venv/bin/python benchmarks/peers.py [--base dense moe] [--task sentiment orders dates]
        [--format nvfp4 mxfp4] [--only modelopt llmc-gptq fp4prep] [--json rows.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TORCH = "torch==2.13.0"
# Each peer's packages, pinned: its environment is named after the first. AutoRound writes
# compressed-tensors' layout only with that package installed (an optional dependency of its).
PACKAGES = {
    "llmcompressor": ["llmcompressor==0.14.0.1"],
    "autoround": ["auto-round==0.16.1", "compressed-tensors==0.20.1"],
}
# quantizer -> (tool, method)
QUANTIZERS = {
    "modelopt": ("modelopt", "default"),
    "llmc-rtn": ("llmcompressor", "rtn"),
    "llmc-gptq": ("llmcompressor", "gptq"),
    "llmc-awq-gptq": ("llmcompressor", "awq-gptq"),
    "autoround": ("autoround", "default"),
    "autoround-fast": ("autoround", "fast"),
    "fp4prep": ("fp4prep", "recipe"),
    "fp4prep-other-order": ("fp4prep", "other-order"),
    "fp4prep-nearest-exponents": ("fp4prep", "nearest-exponents"),
    "fp4prep-every-token": ("fp4prep", "every-token"),
    "fp4prep-best-exponents": ("fp4prep", "best-exponents"),
    "fp4prep-other-scales": ("fp4prep", "other-scales"),
}
# Each tool's name for the format, as fp4prep writes it (NVFP4: weights and inputs; MXFP4: weights).
SCHEMES = {"llmcompressor": {"nvfp4": "NVFP4", "mxfp4": "MXFP4A16"}, "autoround": {"nvfp4": "NVFP4", "mxfp4": "MXFP4A16"}}

MODELOPT_DEFAULT = """
import dataclasses, sys
from pathlib import Path
from fp4prep.pipeline import PipelineConfig, run
from fp4prep.pipeline.recipes import recipe_for
merged, fmt, sequences_from, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
recipe = dataclasses.replace(recipe_for(fmt), steps=())
run(PipelineConfig(base_dir=merged, output_dir=out, quantization=fmt, calibration_file=Path(sequences_from),
                   recipe=recipe, quality_gate=False))
"""

# fp4prep's job with the recipe's GPTQ changed: its columns rounded in the other order, or MXFP4's
# block exponents by compressed-tensors' rule.
CANDIDATE = """
import dataclasses, sys
from pathlib import Path
from fp4prep.pipeline import PipelineConfig, run
from fp4prep.pipeline.recipes import Gptq, recipe_for
base, adapter, fmt, calibration, out, candidate = sys.argv[1:]
recipe = recipe_for(fmt)
change = {"other-order": lambda s: {"activation_order": not s.activation_order},
          "nearest-exponents": lambda s: {"mx_exponents": "nearest"},
          "best-exponents": lambda s: {"mx_exponents": "best"},
          "every-token": lambda s: {"hessian_stride": 1},
          "other-scales": lambda s: {"nv_scales": "max" if s.nv_scales == "search" else "search"}}[candidate]
recipe = dataclasses.replace(
    recipe, steps=tuple(dataclasses.replace(s, **change(s)) if isinstance(s, Gptq) else s for s in recipe.steps))
run(PipelineConfig(base_dir=Path(base), adapter_dir=Path(adapter), output_dir=Path(out), quantization=fmt,
                   calibration_file=Path(calibration), recipe=recipe, quality_gate=False))
"""


def data_dir() -> Path:
    return Path(os.environ.get("FP4PREP_DATA_DIR", Path.home() / ".cache" / "fp4prep")) / "peers"


def environment(tool: str) -> Path:
    """The python of ``tool``'s own virtual environment, made (once per package list) with torch pinned first."""
    packages = PACKAGES[tool]
    env = data_dir() / packages[0].replace("==", "-")
    python = env / "bin" / "python"
    ready = env / ".ready"
    if ready.is_file() and ready.read_text() == " ".join(packages):
        return python
    print(f"installing {' '.join(packages)} into {env} (once)", file=sys.stderr, flush=True)
    venv.create(env, with_pip=True, clear=True)
    constraints = env / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")  # the peer's dependencies may not move torch off this build
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "-c", str(constraints), *packages], check=True)
    ready.write_text(" ".join(packages))
    return python


@dataclasses.dataclass
class Case:
    """One base and adapter: the assets, the PEFT-merged model and the calibration sequences."""

    base: str
    task: str
    assets: Any
    merged: Path
    sequences: Path

    @classmethod
    def prepare(cls, base: str, task: str) -> Case:
        from fp4prep import demo
        from fp4prep.demo import moe
        from fp4prep.demo.tasks import TASKS
        from fp4prep.pipeline import PipelineConfig
        from fp4prep.pipeline.stages import _corpus, _tokenizer

        assets = (moe if base == "moe" else demo).build(task=TASKS[task])
        key = f"{base}-{task}-{_digest(assets.adapter_dir / 'adapter_model.safetensors')}"
        merged, sequences = data_dir() / "merged" / key, data_dir() / "merged" / f"{key}.sequences.json"
        if not (merged / "config.json").is_file():
            _peft_merge(assets.base_dir, assets.adapter_dir, merged)
        if not sequences.is_file():
            config = PipelineConfig(base_dir=assets.base_dir, output_dir=merged / "unused", adapter_dir=assets.adapter_dir,
                                    calibration_file=assets.calibration_file)
            sequences.write_text(json.dumps(_corpus(config, _tokenizer(assets.base_dir)).sequences))
        return cls(base, task, assets, merged, sequences)

    def config(self, fmt: str, parity_prompts: int) -> Any:
        """The evaluator's settings: the PEFT-merged model against every export, on the adapter's task."""
        from fp4prep.pipeline import PipelineConfig

        return PipelineConfig(
            base_dir=self.merged, output_dir=self.merged / "unused", quantization=fmt,
            calibration_file=self.assets.calibration_file, eval_file=self.assets.eval_file,
            parity_prompts=parity_prompts,
        )


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _peft_merge(base: Path, adapter: Path, out: Path) -> None:
    """PEFT's ``merge_and_unload`` of ``adapter`` into ``base``, saved in BF16 (the peers' input)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(base).save_pretrained(partial)
    partial.rename(out)


def quantize(case: Case, quantizer: str, fmt: str, out: Path) -> dict[str, Any]:
    """Run ``quantizer`` into ``out`` in a process of its own: its wall time and peak memory."""
    tool, method = QUANTIZERS[quantizer]
    a = case.assets
    if method == "recipe":
        command = [str(ROOT / ".venv" / "bin" / "fp4prep"), "quantize", "--model-id", str(a.base_dir), "--adapter-directory",
                   str(a.adapter_dir), "--output-directory", str(out), "-c", str(a.calibration_file), "--quantization", fmt,
                   "--no-quality-gate", "--quiet"]
    elif tool == "fp4prep":
        command = [sys.executable, "-c", CANDIDATE, str(a.base_dir), str(a.adapter_dir), fmt, str(a.calibration_file), str(out),
                   method]
    elif tool == "modelopt":
        command = [sys.executable, "-c", MODELOPT_DEFAULT, str(case.merged), fmt, str(case.assets.calibration_file), str(out)]
    else:
        from fp4prep.pipeline.device import resolve

        dtype = str(resolve("cpu").dtype).removeprefix("torch.")  # what fp4prep computes in on this CPU
        command = [str(environment(tool)), str(ROOT / "benchmarks" / "peer_quantize.py"), tool, method, SCHEMES[tool][fmt],
                   str(case.merged), str(case.sequences), str(out), dtype]
    # The quantizer's own output, kept (a long run's progress can be followed there while it runs).
    logs = data_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{case.base}-{case.task}-{fmt}-{quantizer}.log"
    print(f"{quantizer}: its output goes to {log_path}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        peak = _peak_memory(process)
        seconds = time.perf_counter() - started
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return {"failed": " / ".join(tail)[-600:]}
    return {"seconds": seconds, "peak_bytes": peak}


def _peak_memory(process: subprocess.Popen[bytes]) -> int:
    """Wait for ``process``; its own peak resident memory (``VmHWM``, read while it runs). Not the
    rusage of ``wait4``: Linux carries the exec'ing parent's high-water mark over into the child's
    ``ru_maxrss``, so every row would report at least this script's own peak."""
    status, peak = Path(f"/proc/{process.pid}/status"), 0
    while process.poll() is None:
        try:
            line = next(s for s in status.read_text().splitlines() if s.startswith("VmHWM:"))
            peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, StopIteration):
            pass
        time.sleep(0.2)
    return peak


# llm-compressor linearizes the fused routed experts of an architecture it has no per-expert load
# mapping for (Mixtral among them) after loading, and saves them under the linear modules' own names
# (``block_sparse_moe.experts.3.gate_proj``): names neither transformers' nor vLLM's Mixtral loader maps
# (both read ``block_sparse_moe.experts.3.w1``/``w3``/``w2``). Renamed to those before scoring; nothing
# else changes.
HUB_EXPERT_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
_LINEAR_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate|up|down)_proj\.")


def hub_expert_names(checkpoint: Path) -> int:
    """Rename a peer export's per-expert tensors to the names its architecture's loaders read; how many."""
    from safetensors.torch import load_file, save_file

    projections = HUB_EXPERT_NAMES.get(json.loads((checkpoint / "config.json").read_text()).get("model_type"))
    if projections is None:
        return 0

    def hub(name: str) -> str:
        return _LINEAR_EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{projections[m[2]]}.", name)

    renamed = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors = load_file(file)
        moved = sum(hub(n) != n for n in tensors)
        if moved:
            save_file({hub(n): t for n, t in tensors.items()}, file, metadata={"format": "pt"})
            renamed += moved
    index = checkpoint / "model.safetensors.index.json"
    if renamed and index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {hub(n): f for n, f in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    return renamed


def score(case: Case, fmt: str, checkpoint: Path, reference: Any, config: Any) -> dict[str, Any]:
    """The export against the BF16 merged model, in the engine's numerics for the format."""
    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.model.merge import MergedWeights, load_adapter
    from fp4prep.pipeline.model.releases import BaseSource
    from fp4prep.pipeline.stages import parity_of
    from fp4prep.pipeline.validation.reader import DequantizedWeights
    from fp4prep.pipeline.validation.retention import Retention

    behaviour = parity_of(config, checkpoint, reference)
    p = behaviour.parity
    compute = resolve("cpu")
    merged = MergedWeights(BaseSource(case.assets.base_dir), load_adapter(case.assets.adapter_dir), compute.dtype, compute.device)
    kept = Retention(merged, DequantizedWeights(checkpoint, compute.dtype, compute.device)).report()
    return {
        "answer_kl": p.answer_kl, "answer_top1": p.answer_top1, "continuation_top1": p.continuation_top1,
        "identical_greedy": p.identical_greedy, "task": behaviour.task_success, "bf16_task": reference.task_success,
        "retained": kept.pooled if kept else None,
    }


def _cell(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def main() -> None:
    from fp4prep.demo.tasks import TASKS
    from fp4prep.pipeline.stages import parity_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--task", nargs="+", choices=sorted(TASKS), default=["sentiment", "orders", "dates"])
    parser.add_argument("--format", nargs="+", choices=["nvfp4", "mxfp4"], default=["nvfp4", "mxfp4"])
    parser.add_argument("--only", nargs="+", choices=list(QUANTIZERS), default=list(QUANTIZERS))
    parser.add_argument("--parity-prompts", type=int, default=60, help="held-back conversations measured (60: all the demo holds back)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print("| base | adapter | format | quantizer | KL on answers | top-1 on answers | top-1 on continuations | identical greedy "
          "| task (BF16) | change retained | time | peak memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for base in args.base:
        for task in args.task:
            case = Case.prepare(base, task)
            for fmt in args.format:
                config = case.config(fmt, args.parity_prompts)
                reference = parity_reference(config)
                for quantizer in args.only:
                    with tempfile.TemporaryDirectory(prefix="fp4prep-peer-") as tmp:
                        out = Path(tmp) / "out"
                        row = {"base": base, "adapter": task, "format": fmt, "quantizer": quantizer, **quantize(case, quantizer, fmt, out)}
                        if "failed" not in row:
                            if QUANTIZERS[quantizer][0] in PACKAGES:
                                row["renamed"] = hub_expert_names(out)
                            row.update(score(case, fmt, out, reference, config))
                    rows.append(row)
                    if "failed" in row:
                        print(f"| {base} | {task} | {fmt} | {quantizer} | failed: {row['failed']} |||||||||", flush=True)
                        continue
                    print(
                        f"| {base} | {task} | {fmt} | {quantizer} | {row['answer_kl']:.4f} | {row['answer_top1']:.3f} | "
                        f"{row['continuation_top1']:.3f} | {row['identical_greedy']:.2f} | {row['task']:.0%} ({row['bf16_task']:.0%}) | "
                        f"{_cell(row['retained'], '.3f')} | {row['seconds']:.0f} s | {row['peak_bytes'] / 2**30:.2f} GiB |",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
