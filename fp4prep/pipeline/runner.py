"""The one entry point: ``run(config) -> result``.

merge -> calibrate -> quantize -> export -> validate, each stage reporting progress and checking for
cancellation, with one decoder layer's weights in memory at a time: the merged model is a lazy map
over the base's files (``weights``), read layer by layer by a model whose weights live on the meta
device (``streaming``); ModelOpt calibrates it layer by layer and exports it shard by shard; the
reference and the checkpoint are both streamed again for validation.

What a run has finished is kept in its work directory (ModelOpt's per-layer calibration checkpoint,
then the calibrated quantizers, then the export), so a run that stops (a dead worker, a requeued
job, Ctrl-C) continues from there. The checkpoint is moved into ``output_dir`` only after it passed
validation, so a failed or cancelled run leaves nothing half-written there.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from . import corpus as corpus_mod
from . import device as device_mod
from . import export as export_mod
from . import fold, limits, quantize, reader, streaming, validate
from . import parity as parity_mod
from .checkpoint import TensorSource, directory_bytes, read_config
from .config import EVAL_FILE, ParityReport, PipelineConfig, PipelineResult, TaskReport
from .errors import Cancelled, InternalError, PipelineError, UserError
from .merge import load_adapter
from .progress import Progress
from .recipes import Recipe, Thresholds, get_recipe
from .weights import MergedWeights

logger = logging.getLogger(__name__)
RELOAD_CHECK_TOKENS = 128
STATE_FILE = "run.json"  # what the work directory's state was made from
CALIBRATED_FILE = "calibrated.pt"
WRITTEN_DIR = "written"  # weights calibration changed (AWQ), as they are written back
EXPORTED_MARK = "exported"


def run(config: PipelineConfig) -> PipelineResult:
    recipe = config.recipe or get_recipe(config.quantization)
    thresholds = config.thresholds or recipe.thresholds
    progress = Progress(config.progress, config.should_cancel)
    _check_output_dir(config.output_dir)
    compute = device_mod.resolve(config.device)
    streaming.keep_memory_returnable()
    progress.check()
    config.output_dir.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    with _work_dir(config) as work:
        try:
            result = _run(config, recipe, thresholds, progress, work, compute)
        except (UserError, PipelineError, Cancelled):
            raise
        except Exception as exc:
            logger.exception("pipeline failed")
            raise InternalError(f"internal error during {progress.current}: {exc}") from exc
        shutil.move(str(work / "out"), str(config.output_dir))
        if config.work_dir is not None:  # done: nothing is left to resume
            _clear(work)
    result.output_dir = config.output_dir
    return result


def parity_of(config: PipelineConfig, checkpoint: Path) -> ParityReport:
    """Parity of an existing ``checkpoint`` with the BF16 merged model of ``config``'s base and
    adapter, on the held-back examples a run with ``config`` validates on (damage studies, audits)."""
    examples = _corpus(config, _tokenizer(config.base_dir)).parity
    compute = device_mod.resolve(config.device)
    adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
    merged = MergedWeights(TensorSource(config.base_dir), adapter, compute.dtype, compute.device)
    reference = streaming.build(read_config(config.base_dir), merged, compute, config.base_dir)
    candidate = reader.load(checkpoint, compute)
    return parity_mod.token_parity(reference, candidate, examples, config.continuation_tokens)


def _corpus(
    config: PipelineConfig, tokenizer: Any, report: Callable[[float], None] = lambda f: None
) -> corpus_mod.Corpus:
    """The calibration sequences and held-back parity examples ``config`` asks for."""
    return corpus_mod.build(
        tokenizer,
        calibration_file=config.calibration_file,
        general_text_file=config.general_text_file,
        total_tokens=max(config.calibration_tokens, 2 * config.user_token_minimum),
        sequence_length=config.sequence_length,
        user_token_minimum=config.user_token_minimum,
        holdout_fraction=config.holdout_fraction,
        parity_prompts=config.parity_prompts,
        seed=config.seed,
        report=report,
    )


def _clear(directory: Path) -> None:
    for child in directory.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


@contextlib.contextmanager
def _work_dir(config: PipelineConfig) -> Iterator[Path]:
    if config.work_dir is None:
        with tempfile.TemporaryDirectory(prefix=".fp4prep-", dir=config.output_dir.parent) as tmp:
            yield Path(tmp)
        return
    config.work_dir.mkdir(parents=True, exist_ok=True)
    yield config.work_dir


def _check_output_dir(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"output directory {path} already exists and is not empty")
    if path.exists():
        path.rmdir()


def _claim_state(work: Path, fingerprint: dict[str, Any]) -> None:
    """Keep the work directory's state only if it was made from these same inputs."""
    path = work / STATE_FILE
    try:
        same = json.loads(path.read_text()) == fingerprint
    except (OSError, ValueError):
        same = False
    if not same:
        _clear(work)
        path.write_text(json.dumps(fingerprint, indent=2) + "\n")


def _fingerprint(config: PipelineConfig, compute: device_mod.Compute, sha: str | None) -> dict[str, Any]:
    import fp4prep

    return {
        "fp4prep": fp4prep.__version__,
        "base": str(config.base_dir.resolve()),
        "adapter": str(config.adapter_dir.resolve()) if config.adapter_dir else None,
        "calibration_sha256": sha,
        "general_text": str(config.general_text_file) if config.general_text_file else None,
        "quantization": config.quantization,
        "recipe": repr(config.recipe) if config.recipe else None,
        "calibration_tokens": config.calibration_tokens,
        "sequence_length": config.sequence_length,
        "user_token_minimum": config.user_token_minimum,
        "seed": config.seed,
        "device": compute.device.type,
        "dtype": str(compute.dtype),
    }


def _run(
    config: PipelineConfig,
    recipe: Recipe,
    thresholds: Thresholds,
    progress: Progress,
    work: Path,
    compute: device_mod.Compute,
) -> PipelineResult:
    out = work / "out"
    with progress.stage("merging"):
        base_config = read_config(config.base_dir)
        source = TensorSource(config.base_dir)
        adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
        # Plans the merge against the base's shapes (refusing what can't apply); nothing is merged
        # until a layer's weights are read.
        merged = MergedWeights(source, adapter, compute.dtype, compute.device)
        progress.update(0.5)
        tokenizer = _tokenizer(config.base_dir)
        model = streaming.skeleton(base_config, merged, compute, config.base_dir)
        bf16_bytes = 2 * sum(merged.numel(n) for n in merged)
        total = max(config.calibration_tokens, 2 * config.user_token_minimum)
        limits.check_memory(model, merged, compute, total)
        limits.check_disk(merged, recipe, work, config.output_dir, int(model.config.hidden_size), total)
        streaming.attach(model, merged, compute)

    with progress.stage("calibrating"):
        corpus = _corpus(config, tokenizer, progress.sub(0.0, 0.1))
        _claim_state(work, _fingerprint(config, compute, corpus.stats.calibration_sha256))
        if recipe.mutates_weights:
            merged.keep_written(work / WRITTEN_DIR)
        calibrated = work / CALIBRATED_FILE
        resumed_from: int | None = None
        factors: fold.Factors = {}
        if calibrated.is_file():
            restored = quantize.restore_quantizers(model, calibrated, compute)
            expert_tokens, factors = restored["expert_tokens"], restored.get("fold_factors", {})
            resumed_from = len(streaming.decoder_layers(model)[1])
            _note(config, f"Resuming: every layer was calibrated by an earlier run ({resumed_from} layers)")
        else:
            start = quantize.resume_layer(work)
            if start:
                resumed_from = start
                n = len(streaming.decoder_layers(model)[1])
                _note(config, f"Resuming calibration at layer {start + 1} of {n}: an earlier run finished layers 1-{start}")
            expert_tokens, factors = quantize.calibrate(
                model, recipe, corpus.sequences, compute, progress.sub(0.1, 1.0), state_dir=work
            )

    with progress.stage("quantizing"):
        if not calibrated.is_file():
            if recipe.folds_pre_quant_scale:
                factors = {**factors, **fold.fold_pre_quant_scales(model)}
            quantize.share_fused_scales(model)
            quantize.save_quantizers(model, calibrated, {"expert_tokens": expert_tokens, "fold_factors": factors})
            shutil.rmtree(work / quantize.CALIBRATION_DIR, ignore_errors=True)
            shutil.rmtree(work / quantize.FOLD_FACTORS_DIR, ignore_errors=True)
        quantize.use_reference_numerics(model)
        reload_examples = corpus.parity[:1]
        reference = [parity_mod.logits(model, e.input_ids[:RELOAD_CHECK_TOKENS]) for e in reload_examples]

    with progress.stage("exporting"):
        if not (work / EXPORTED_MARK).is_file():
            shutil.rmtree(out, ignore_errors=True)
            export_mod.export(model, recipe, tokenizer, out)
            (work / EXPORTED_MARK).touch()
        del model
        gc.collect()

    with progress.stage("validating"):
        checks = validate.structure(out, recipe, bf16_bytes)
        candidate = reader.load(out, compute)
        reload_diff = parity_mod.reload_difference(reference, candidate, reload_examples)
        progress.update(0.1)
        # The BF16 merged model again, read from the base as the calibrated one was: merging is
        # cheap and deterministic, and a BF16 copy of a large base is not. Not the calibrated
        # model's map when calibration changed weights (those are the checkpoint's, not BF16's).
        if recipe.mutates_weights:
            merged = MergedWeights(source, adapter, compute.dtype, compute.device)
        kept = (
            validate.retention(merged, reader.DequantizedWeights(out, torch.float32, compute.device), factors)
            if merged.targets()
            else None
        )
        progress.update(0.2)
        bf16_model = streaming.build(base_config, merged, compute, config.base_dir)
        task = None
        eval_file = config.eval_file or _adapter_eval_file(config.adapter_dir)
        parity_end = 0.6 if eval_file is not None else 1.0
        parity = parity_mod.token_parity(
            bf16_model, candidate, corpus.parity, config.continuation_tokens, progress.sub(0.2, parity_end)
        )
        if eval_file is not None:
            bf16_score, n = parity_mod.task_success(bf16_model, tokenizer, eval_file, progress.sub(0.6, 0.8))
            quant_score, _ = parity_mod.task_success(candidate, tokenizer, eval_file, progress.sub(0.8, 1.0))
            task = TaskReport(prompts=n, bf16_success=bf16_score, quantized_success=quant_score)
        del bf16_model, candidate
        missed = validate.misses(thresholds, parity, reload_diff, kept)
        if missed and config.quality_gate:
            raise PipelineError("the checkpoint missed its quality thresholds: " + "; ".join(missed))
        checks += validate.summary(parity, reload_diff, kept)
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
            device=compute.describe(),
            quality_misses=missed,
            resumed_from_layer=resumed_from,
        )
        export_mod.write_model_card(out, _lineage(config, recipe, result))
    result.stage_seconds = dict(progress.stage_seconds)
    return result


def _note(config: PipelineConfig, message: str) -> None:
    logger.info(message)
    if config.notify is not None:
        config.notify(message)


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
            "calibration": recipe.calibration,
            "quant_algo": recipe.quant_algo,
            "layout": recipe.layout,
            "calibration_tokens": result.corpus.user_tokens + result.corpus.general_tokens,
            "sequence_length": config.sequence_length,
        },
        "metrics": {
            k: metrics[k]
            for k in ("parity", "retention", "task", "reload_max_logit_diff", "corpus", "expert_tokens")
        },
        "quality_gate": {"enforced": config.quality_gate, "misses": result.quality_misses},
        "device": result.device,
        "tools": export_mod.tool_versions(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **{k: v for k, v in config.lineage.items() if k not in ("name", "base", "adapter")},
    }
