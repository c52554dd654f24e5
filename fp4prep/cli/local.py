"""The local commands: ``fp4prep quantize`` runs the pipeline on a checkpoint directory (the offline
command); ``fp4prep demo`` builds the embedded demo assets and runs ``quantize`` on them.
No server is involved."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from fp4prep.demo.tasks import TASKS
from fp4prep.pipeline.recipes import RECIPES

from . import exits


class StageBars:
    """One progress bar per stage, on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stage: str | None = None
        self.bar: Any = None

    def __call__(self, stage: str, fraction: float) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(
                total=100,
                desc=f"{stage:<12}",
                unit="%",
                file=sys.stderr,
                bar_format="{desc} {bar} {percentage:3.0f}% {elapsed}",
            )
        target = int(round(fraction * 100))
        self.bar.update(max(0, target - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def summary(result: Any) -> str:
    from fp4prep.pipeline.validation import report

    data = result.to_dict()
    corpus = result.corpus
    lines = [
        f"Wrote {result.quantization} checkpoint to {result.output_dir}",
        *(f"  {line}" for line in report.headline(data)),
        "",
        *report.text(report.figures(data)),
        f"  calibrated on {corpus.user_tokens:,} user + {corpus.general_tokens:,} general tokens, "
        f"{corpus.held_out_conversations} conversations held back",
    ]
    if result.reads:
        from fp4prep.pipeline.model.reads import describe

        lines.append(f"  read {describe(result.reads)}")
    return "\n".join(lines)


# What ``quantize`` and ``demo`` import, all from the [pipeline] extra.
PIPELINE_MODULES = ("torch", "modelopt", "transformers", "peft", "safetensors", "accelerate", "gguf")
PIPELINE_INSTALL = "pip install torch==2.13.0 && pip install 'fp4prep[pipeline]'"


def missing_pipeline() -> str | None:
    """The one line to print when the [pipeline] extra isn't installed, else None."""
    import importlib.util

    missing = [name for name in PIPELINE_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"this command runs the pipeline, which needs {', '.join(missing)}: {PIPELINE_INSTALL}"


def needs_pipeline(command: Any) -> Any:
    def checked(args: argparse.Namespace) -> int:
        problem = missing_pipeline()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return exits.INPUT
        return int(command(args))

    return checked


def default_quantization(base: Path) -> str:
    """nvfp4, or the release's own format for a base that ships in FP4 (a model prepared from one
    is written in its format)."""
    from fp4prep.pipeline.model.releases import weights_format

    stored = weights_format(base) if (base / "config.json").is_file() else "bf16"
    return stored if stored in ("nvfp4", "mxfp4") else "nvfp4"


def cmd_quantize(args: argparse.Namespace) -> int:
    from fp4prep.pipeline import Cancelled, PipelineConfig, PipelineError, UserError, run

    bars = StageBars(enabled=not args.quiet)
    try:
        quantization = args.quantization or default_quantization(args.model_id)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.INPUT
    config = PipelineConfig(
        base_dir=args.model_id,
        adapter_dir=args.adapter_directory,
        output_dir=args.output_directory,
        quantization=quantization,
        calibration_file=args.calibration_file,
        general_text_file=args.general_text_file,
        eval_file=args.eval_file,
        calibration_tokens=args.calibration_tokens,
        user_token_minimum=args.user_token_minimum,
        device=args.device,
        work_dir=args.work_dir,
        quality_gate=not args.no_quality_gate,
        serving_hardware=args.serve_on,
        progress=bars,
        notify=lambda message: print(message, file=sys.stderr),
    )
    try:
        result = run(config)
    except UserError as exc:
        bars.close()
        print(f"error: {exc}", file=sys.stderr)
        return exits.INPUT
    except PipelineError as exc:
        bars.close()
        print(f"error: {exc}", file=sys.stderr)
        return exits.ERROR
    except (Cancelled, KeyboardInterrupt):
        bars.close()
        print("cancelled: nothing was written", file=sys.stderr)
        return exits.STOPPED
    bars.close()
    for miss in result.quality_misses:
        print(f"warning: below the recipe's bar: {miss}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        print(summary(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fp4prep import demo

    assets = demo.build(force=args.rebuild, task=TASKS[args.task])
    args.model_id = assets.base_dir
    args.adapter_directory = assets.adapter_dir
    args.calibration_file = assets.calibration_file
    args.general_text_file = None
    args.eval_file = None
    args.calibration_tokens = 8192
    args.user_token_minimum = 4096
    args.quantization = args.quantization or "nvfp4"
    if args.output_directory is None:
        suffix = "" if args.task == "sentiment" else f"-{args.task}"
        args.output_directory = Path("var") / f"demo-{args.quantization}{suffix}"
    return cmd_quantize(args)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        choices=tuple(RECIPES),
        help="output format (default nvfp4; for a base that ships in FP4, the release's own format)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (a CUDA device when there is one), cpu, cuda or cuda:N (default auto)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep resumable state here: a rerun with the same inputs continues from the last finished layer",
    )
    p.add_argument(
        "--no-quality-gate",
        action="store_true",
        help="write the checkpoint even if it misses the recipe's thresholds (each miss is a warning)",
    )
    p.add_argument(
        "--serve-on",
        action="append",
        default=[],
        metavar="GPU",
        help="a GPU it will be served on, e.g. 'NVIDIA B200' (repeatable): where the engine computes "
        "there other than the checkpoint declares (MXFP4 on Blackwell), it is measured that way too",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_commands(sub: Any) -> None:

    q = sub.add_parser("quantize", help="merge an adapter and quantize a checkpoint locally")
    q.add_argument(
        "--model-id", required=True, type=Path, help="base checkpoint directory (BF16, FP8 blocks, or an NVFP4/MXFP4 release)"
    )
    q.add_argument("--adapter-directory", type=Path, help="PEFT LoRA adapter directory to merge first")
    q.add_argument(
        "--output-directory", required=True, type=Path, help="where the checkpoint goes (new or empty)"
    )
    q.add_argument(
        "--calibration-file", "-c", type=Path, help="JSONL conversations for half the calibration corpus"
    )
    q.add_argument("--general-text-file", type=Path, help="general text (.txt or .jsonl); default: embedded")
    q.add_argument("--eval-file", type=Path, help="JSONL of {messages, expected} to score the adapter's task")
    q.add_argument(
        "--calibration-tokens", type=int, default=8192, help="corpus size in tokens (default 8192)"
    )
    q.add_argument(
        "--user-token-minimum", type=int, default=0, help="least tokens the calibration file must supply"
    )
    _add_run_options(q)
    q.set_defaults(func=needs_pipeline(cmd_quantize))

    d = sub.add_parser("demo", help="build the embedded demo (SmolLM2-135M + LoRA) and quantize it")
    d.add_argument(
        "--output-directory", type=Path, help="default var/demo-<quantization>, var/demo-<quantization>-<task> for another task"
    )
    d.add_argument("--rebuild", action="store_true", help="rebuild the cached demo assets")
    d.add_argument(
        "--task", choices=sorted(TASKS), default="sentiment",
        help="which demo adapter: sentiment labels (the default), JSON order extraction, ISO dates",
    )
    _add_run_options(d)
    d.set_defaults(func=needs_pipeline(cmd_demo))


def quiet_libraries() -> None:
    """Library chatter (deprecations, shard bars) would bury our bars; our errors print anyway."""
    warnings.filterwarnings("ignore")
    logging.getLogger("modelopt").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
