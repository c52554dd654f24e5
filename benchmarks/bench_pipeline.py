"""Benchmark: fp4prep's pipeline against a plain reference run on the demo model.

Reference: PEFT ``merge_and_unload`` + ``mtq.quantize`` with ModelOpt's default config for the
format + ``export_hf_checkpoint``. On a machine without CUDA the reference gets our CPU backend
too (ModelOpt's default config can't calibrate FP4 on the CPU otherwise); nothing else changes.
Each side runs in its own process, so peak RSS is its own. Both checkpoints are then scored with
the same parity measurement against the BF16 merged model on the same held-back conversations.

    .venv/bin/python benchmarks/bench_pipeline.py [--quantization nvfp4|mxfp4|fp8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

REFERENCE_CONFIG = {"nvfp4": "NVFP4_DEFAULT_CFG", "mxfp4": "MXFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG"}
CALIBRATION_TOKENS = 8192
SEQUENCE_LENGTH = 512


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def corpus_for(tokenizer, assets):  # noqa: ANN001, ANN201
    from fp4prep.pipeline.inputs import corpus

    return corpus.build(
        tokenizer,
        calibration_file=assets.calibration_file,
        general_text_file=None,
        total_tokens=CALIBRATION_TOKENS,
        sequence_length=SEQUENCE_LENGTH,
        user_token_minimum=4096,
        holdout_fraction=0.1,
        parity_prompts=16,
        seed=0,
    )


def child_ours(quantization: str, out: Path) -> dict:
    # The same imports the reference makes before its clock starts, so neither side times them.
    import modelopt.torch.export  # noqa: F401
    import modelopt.torch.quantization  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, run

    assets = demo.build()
    peak_before_validation = {}

    def progress(stage: str, fraction: float) -> None:
        if stage == "validating" and not peak_before_validation:
            peak_before_validation["mib"] = peak_rss_mib()

    started = time.perf_counter()
    result = run(
        PipelineConfig(
            base_dir=assets.base_dir,
            adapter_dir=assets.adapter_dir,
            output_dir=out,
            calibration_file=assets.calibration_file,
            quantization=quantization,
            calibration_tokens=CALIBRATION_TOKENS,
            user_token_minimum=4096,
            sequence_length=SEQUENCE_LENGTH,
            progress=progress,
        )
    )
    seconds = dict(result.stage_seconds)
    return {
        "stages": seconds,
        "total_excluding_validation": sum(v for k, v in seconds.items() if k != "validating"),
        "total": time.perf_counter() - started,
        "peak_rss_mib_excluding_validation": peak_before_validation["mib"],
        "peak_rss_mib": peak_rss_mib(),
        "reads": result.reads,
    }


def child_reference(quantization: str, out: Path) -> dict:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp4prep import demo
    from fp4prep.pipeline.device import resolve
    from fp4prep.pipeline.modelopt_ext import backend
    from fp4prep.pipeline.modelopt_ext.session import Session

    assets = demo.build()
    # The CPU backend, registered for the rest of this child process.
    Session(resolve("auto")).__enter__()
    stages = {}
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(assets.base_dir, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, assets.adapter_dir).merge_and_unload()
    stages["merging"] = time.perf_counter() - t

    t = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(assets.base_dir)
    sequences = corpus_for(tokenizer, assets).sequences
    config = getattr(mtq, REFERENCE_CONFIG[quantization])
    if not torch.cuda.is_available():
        import copy

        config = copy.deepcopy(config)
        for entry in config["quant_cfg"]:
            cfg = entry.get("cfg")
            if isinstance(cfg, dict) and backend.handles(cfg.get("num_bits")):
                cfg["backend"] = backend.NAME

    def forward_loop(m):  # noqa: ANN001, ANN202
        with torch.no_grad():
            for s in sequences:
                m(torch.tensor([s]))

    mtq.quantize(model, config, forward_loop)
    stages["calibrating+quantizing"] = time.perf_counter() - t
    t = time.perf_counter()
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=out)
    tokenizer.save_pretrained(out)
    stages["exporting"] = time.perf_counter() - t
    total = sum(stages.values())
    return {
        "stages": stages,
        "total_excluding_validation": total,
        "total": total,
        "peak_rss_mib_excluding_validation": peak_rss_mib(),
        "peak_rss_mib": peak_rss_mib(),
    }


def parity(out: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from fp4prep import demo
    from fp4prep.pipeline import device
    from fp4prep.pipeline.model import merge, streaming
    from fp4prep.pipeline.model import safetensors as checkpoint
    from fp4prep.pipeline.model.merge import MergedWeights
    from fp4prep.pipeline.validation import parity as behaviour
    from fp4prep.pipeline.validation import reader
    from fp4prep.pipeline.validation import task as task_set

    assets = demo.build()
    tokenizer = AutoTokenizer.from_pretrained(assets.base_dir)
    examples = corpus_for(tokenizer, assets).parity
    compute = device.resolve("auto")
    source = checkpoint.TensorSource(assets.base_dir)
    merged = MergedWeights(source, merge.load_adapter(assets.adapter_dir), compute.dtype, compute.device)
    bf16 = streaming.build(checkpoint.read_config(assets.base_dir), merged, compute, assets.base_dir)
    candidate = reader.load(out, compute)
    tasks = task_set.load(assets.eval_file, tokenizer, behaviour.end_of_turn(bf16))
    measured = behaviour.compare(behaviour.reference_of(bf16, examples, 16, task=tasks), candidate)
    report, task = measured.parity, measured.task_success
    del bf16, candidate
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {
        "top1_agreement": report.top1_agreement,
        "mean_kl": report.mean_kl,
        "answer_kl": report.answer_kl,
        "continuation_top1": report.continuation_top1,
        "identical_greedy": report.identical_greedy,
        "task_success": task,
    }


def backend_speed() -> str:
    import torch

    from fp4prep.pipeline.formats import numerics

    x = torch.randn(4096, 4096, dtype=torch.bfloat16)
    lines = []
    for name, fn in (
        ("nvfp4", lambda: numerics.nvfp4_fake_quant(x, 16, x.abs().amax())),
        ("mxfp4", lambda: numerics.mxfp4_fake_quant(x, 32)),
    ):
        fn()
        started = time.perf_counter()
        for _ in range(3):
            fn()
        ms = (time.perf_counter() - started) / 3 * 1000
        lines.append(
            f"  {name} fake-quant of a 4096x4096 BF16 tensor: {ms:.0f} ms ({x.numel() / ms / 1e3:.0f} M values/s)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="nvfp4", choices=sorted(REFERENCE_CONFIG))
    parser.add_argument("--child", choices=["ours", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fn = child_ours if args.child == "ours" else child_reference
        print(json.dumps(fn(args.quantization, args.out)))
        return

    from fp4prep import demo

    demo.build()  # outside the timed runs
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("ours", "reference"):
            out = Path(tmp) / side
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    side,
                    "--quantization",
                    args.quantization,
                    "--out",
                    str(out),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                sys.exit(f"{side} run failed:\n{done.stderr[-4000:]}")
            results[side] = json.loads(done.stdout.strip().splitlines()[-1])
            results[side]["parity"] = parity(out)
    from fp4prep.pipeline.model.reads import describe

    ours, ref = results["ours"], results["reference"]
    print(
        f"fp4prep benchmark on the demo model (SmolLM2-135M + LoRA), {args.quantization}, "
        f"{CALIBRATION_TOKENS} calibration tokens"
    )
    for side in ("ours", "reference"):
        r = results[side]
        print(f"\n{side}:")
        for stage, seconds in r["stages"].items():
            print(f"  {stage:<24} {seconds:7.1f} s")
        print(f"  {'total (no validation)':<24} {r['total_excluding_validation']:7.1f} s")
        print(f"  {'peak RSS (no validation)':<24} {r['peak_rss_mib_excluding_validation']:7.0f} MiB")
        print(f"  {'peak RSS (whole run)':<24} {r['peak_rss_mib']:7.0f} MiB")
        if r.get("reads"):
            print(f"  read: {describe(r['reads'])}")
        p = r["parity"]
        print(
            f"  parity: on answers KL {p['answer_kl']:.4f}, top-1 on BF16's continuations {p['continuation_top1']:.3f}; "
            f"whole conversations top-1 {p['top1_agreement']:.3f}, KL {p['mean_kl']:.4f}; "
            f"identical greedy {p['identical_greedy']:.2f}, adapter task {p['task_success']:.0%}"
        )
    print("\nCPU fake-quant backend:")
    print(backend_speed())
    print("\nratios (ours / reference):")
    print(
        f"  time excluding validation  {ours['total_excluding_validation'] / ref['total_excluding_validation']:.2f}x"
        "  (the recipe's AWQ search and GPTQ against max calibration)"
    )
    print(
        f"  peak RSS excluding validation {ours['peak_rss_mib_excluding_validation'] / ref['peak_rss_mib']:.2f}x"
        "  (goal <= 1.30)"
    )
    print(
        f"  whole gated job            {ours['total'] / ref['total']:.2f}x  (ours with validation, "
        f"{ours['total']:.1f} s, against the reference without, {ref['total']:.1f} s; goal <= 2)"
    )
    print(f"  peak RSS whole run         {ours['peak_rss_mib'] / ref['peak_rss_mib']:.2f}x")
    print(
        f"  top-1 agreement            {ours['parity']['top1_agreement'] / ref['parity']['top1_agreement']:.2f}x"
        "  (goal >= 1.00)"
    )
    print(
        f"  mean KL                    {ours['parity']['mean_kl'] / ref['parity']['mean_kl']:.2f}x  (lower is better)"
    )


if __name__ == "__main__":
    main()
