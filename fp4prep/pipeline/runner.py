"""The one entry point: ``run(config) -> result``.

merge -> calibrate -> quantize -> export -> validate, each stage reporting progress and checking for
cancellation. Output is written to a temporary sibling directory and moved into place only after
validation passed, so a failed or cancelled run leaves nothing half-written.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from . import corpus as corpus_mod
from . import export as export_mod
from . import merge as merge_mod
from . import quantize, reader, validate
from .checkpoint import TensorSource, build_model, directory_bytes, read_config
from .config import EVAL_FILE, PipelineConfig, PipelineResult, TaskReport
from .errors import Cancelled, PipelineError, UserError
from .progress import Progress
from .recipes import get_recipe

logger = logging.getLogger(__name__)
RELOAD_CHECK_TOKENS = 128


def run(config: PipelineConfig) -> PipelineResult:
    recipe = get_recipe(config.quantization)
    thresholds = config.thresholds or recipe.thresholds
    progress = Progress(config.progress, config.should_cancel)
    _check_output_dir(config.output_dir)
    progress.check()
    config.output_dir.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    with tempfile.TemporaryDirectory(prefix=".fp4prep-", dir=config.output_dir.parent) as tmp:
        work = Path(tmp)
        try:
            result = _run(config, recipe, thresholds, progress, work)
        except (UserError, PipelineError, Cancelled):
            raise
        except Exception as exc:
            logger.exception("pipeline failed")
            raise PipelineError(f"internal error during {progress.current}: {exc}") from exc
        shutil.move(str(work / "out"), str(config.output_dir))
    result.output_dir = config.output_dir
    return result


def _check_output_dir(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"output directory {path} already exists and is not empty")
    if path.exists():
        path.rmdir()


def _run(
    config: PipelineConfig, recipe: Any, thresholds: Any, progress: Progress, work: Path
) -> PipelineResult:
    out = work / "out"
    with progress.stage("merging"):
        base_config = read_config(config.base_dir)
        source = TensorSource(config.base_dir)
        adapter = merge_mod.load_adapter(config.adapter_dir) if config.adapter_dir else None
        state, targets = _merged(source, adapter)
        progress.update(0.7)
        model = build_model(base_config, state)
        del state
        tokenizer = _tokenizer(config.base_dir)
        bf16_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())

    with progress.stage("calibrating"):
        total = max(config.calibration_tokens, 2 * config.user_token_minimum)
        corpus = corpus_mod.build(
            tokenizer,
            calibration_file=config.calibration_file,
            general_text_file=config.general_text_file,
            total_tokens=total,
            sequence_length=config.sequence_length,
            user_token_minimum=config.user_token_minimum,
            holdout_fraction=config.holdout_fraction,
            parity_prompts=config.parity_prompts,
            seed=config.seed,
            report=progress.sub(0.0, 0.1),
        )
        expert_tokens = quantize.calibrate(model, recipe, corpus.sequences, progress.sub(0.1, 1.0))

    with progress.stage("quantizing"):
        quantize.share_fused_scales(model)
        quantize.use_reference_numerics(model)
        reload_examples = corpus.parity[:1]
        reference = [validate.logits(model, e.input_ids[:RELOAD_CHECK_TOKENS]) for e in reload_examples]

    with progress.stage("exporting"):
        export_mod.export(model, recipe, tokenizer, out)
        del model
        gc.collect()

    with progress.stage("validating"):
        checks = validate.structure(out, recipe, bf16_bytes)
        candidate = reader.load(out)
        reload_diff = validate.reload_difference(reference, candidate, reload_examples)
        progress.update(0.1)
        # The BF16 merged model again, recomputed rather than kept on disk: merging is cheap and
        # deterministic, and a full BF16 copy of a large base is not.
        state, _ = _merged(source, adapter)
        kept = validate.retention(source, state, candidate.state_dict(), targets) if targets else None
        progress.update(0.2)
        bf16_model = build_model(base_config, state)
        del state
        task = None
        eval_file = config.eval_file or _adapter_eval_file(config.adapter_dir)
        parity_end = 0.6 if eval_file is not None else 1.0
        parity = validate.token_parity(
            bf16_model, candidate, corpus.parity, config.continuation_tokens, progress.sub(0.2, parity_end)
        )
        if eval_file is not None:
            bf16_score, n = validate.task_success(bf16_model, tokenizer, eval_file, progress.sub(0.6, 0.8))
            quant_score, _ = validate.task_success(candidate, tokenizer, eval_file, progress.sub(0.8, 1.0))
            task = TaskReport(prompts=n, bf16_success=bf16_score, quantized_success=quant_score)
        del bf16_model, candidate
        checks += validate.enforce(thresholds, parity, reload_diff, kept)
        result = PipelineResult(
            output_dir=out,
            quantization=recipe.name,
            stage_seconds=dict(progress.stage_seconds),
            bf16_bytes=bf16_bytes,
            output_bytes=directory_bytes(out),
            corpus=corpus.stats,
            parity=parity,
            reload_max_logit_diff=reload_diff,
            retention=kept,
            expert_tokens=expert_tokens,
            checks=checks,
            task=task,
        )
        export_mod.write_model_card(out, _lineage(config, recipe, result))
    result.stage_seconds = dict(progress.stage_seconds)
    return result


def _merged(
    source: TensorSource, adapter: merge_mod.Adapter | None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The base's tensors in BF16 with the adapter merged in, and the names it changed."""
    state = dict(source.items())
    targets = merge_mod.merge(state, adapter) if adapter else []
    return state, targets


def _tokenizer(base_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"{base_dir} has no usable tokenizer ({exc})") from None
    if not tokenizer.chat_template:
        raise UserError(f"{base_dir} has no chat template: conversations can't be rendered")
    return tokenizer


def _adapter_eval_file(adapter_dir: Path | None) -> Path | None:
    if adapter_dir is None:
        return None
    path = adapter_dir / EVAL_FILE
    return path if path.is_file() else None


def _lineage(config: PipelineConfig, recipe: Any, result: PipelineResult) -> dict[str, Any]:
    metrics = result.to_dict()
    if metrics.get("retention"):
        metrics["retention"] = {k: v for k, v in metrics["retention"].items() if k != "per_tensor"}
    return {
        "name": config.lineage.get("name"),
        "base": config.lineage.get("base", str(config.base_dir)),
        "adapter": config.lineage.get("adapter", str(config.adapter_dir) if config.adapter_dir else None),
        "calibration_sha256": result.corpus.calibration_sha256,
        "recipe": {
            "name": recipe.name,
            "modelopt_config": recipe.modelopt_config,
            "quant_algo": recipe.quant_algo,
            "layout": recipe.layout,
            "calibration_tokens": result.corpus.user_tokens + result.corpus.general_tokens,
            "sequence_length": config.sequence_length,
        },
        "metrics": {
            k: metrics[k]
            for k in ("parity", "retention", "task", "reload_max_logit_diff", "corpus", "expert_tokens")
        },
        "tools": export_mod.tool_versions(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **{k: v for k, v in config.lineage.items() if k not in ("name", "base", "adapter")},
    }
