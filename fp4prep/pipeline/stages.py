"""The one entry point: ``run(config) -> result``, one function per stage.

merge -> calibrate -> quantize -> export -> validate, each stage reporting progress and checking for
cancellation, with one decoder layer's weights in memory at a time: the merged model is a lazy map
over the base's files (``model.merge``), read layer by layer by a model whose weights live on the
meta device (``model.streaming``); ModelOpt calibrates it layer by layer (``calibrate``) and exports
it shard by shard (``export``); the reference and the checkpoint are both streamed again for
validation.

What a run has finished is kept in its work directory (``workdir``), so a run that stops continues
from there. The checkpoint is moved into ``output_dir`` only after it passed validation, so a failed
or cancelled run leaves nothing half-written there.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import device as device_mod
from . import preflight, serving
from .algorithms.mixed import GroupError
from .calibrate import Calibrated, calibrate
from .config import ParityReport, PipelineConfig, PipelineResult, ServingReport, TaskReport
from .errors import Cancelled, InternalError, PipelineError, UserError
from .export import export, model_card
from .export.reference import ReloadReference
from .inputs import corpus as corpus_mod
from .model import memory, streaming
from .model.merge import Adapter, MergedWeights, load_adapter
from .model.reads import ReadTally, safetensors_bytes, tallying
from .model.safetensors import TensorSource, directory_bytes, read_config
from .modelopt_ext import quantizers
from .modelopt_ext.block_scales import BlockScales
from .modelopt_ext.session import Session
from .progress import Progress
from .recipes import Recipe, recipe_for
from .validation import first_round, gate, parity, reader, report, retention, structure
from .validation import task as task_mod
from .validation.prompt_cache import FirstRun
from .workdir import WorkDir, fingerprint, opened

logger = logging.getLogger(__name__)
RELOAD_CHECK_TOKENS = 128


@dataclass
class _Run:
    """One run's inputs and what its stages hand each other."""

    config: PipelineConfig
    recipe: Recipe
    progress: Progress
    work: WorkDir
    compute: device_mod.Compute
    session: Session
    source: TensorSource | None = None
    adapter: Adapter | None = None
    merged: MergedWeights | None = None
    tokenizer: Any = None
    model: Any = None
    bf16_bytes: int = 0
    calibration_bytes: int = 0  # what calibrating one layer needs on the device (``preflight``)
    corpus: corpus_mod.Corpus | None = None
    calibrated: Calibrated | None = None
    scales: BlockScales | None = None
    resumed_from: int | None = None
    reload: parity.Reload | None = None  # the calibrated model's logits on a held-back example
    first_round: FirstRun | None = None  # validation's first round, run in calibration's walk
    reads: ReadTally | None = None


def run(config: PipelineConfig) -> PipelineResult:
    recipe = config.recipe or recipe_for(config.quantization, config.serving_hardware)
    if recipe.fp8_modules:
        raise PipelineError(
            "projections kept in FP8 make a mixed-precision checkpoint, which this pipeline does not export yet "
            "(its reader and structure check take one format per checkpoint); benchmarks/mixed_precision.py measures them"
        )
    progress = Progress(config.progress, config.should_cancel)
    _check_output_dir(config.output_dir)
    compute = device_mod.resolve(config.device)
    memory.keep_memory_returnable()
    memory.release(compute.device)  # what a run before this one in the process left (a failed one's models)
    try:
        return _run_stages(config, recipe, progress, compute)
    finally:
        memory.release(compute.device)


def _run_stages(config: PipelineConfig, recipe: Recipe, progress: Progress, compute: device_mod.Compute) -> PipelineResult:
    progress.check()
    config.output_dir.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    with opened(config.work_dir, config.output_dir) as work:
        state = _Run(config, recipe, progress, work, compute, Session(compute))
        # The base, the checkpoint, and what the run keeps on disk until export reads it: the weights
        # calibration changed (one file each under written/) and the static block scales (one file
        # per layer under block_scales/).
        sources = {
            "base": config.base_dir, "checkpoint": work.out, "written": work.written, "block_scales": work.block_scales,
        }
        state.reads = ReadTally(sources, lambda: progress.current)
        try:
            with tallying(state.reads):
                _merge(state)  # its checks before ModelOpt is imported (seconds): bad input fails at once
                with state.session:
                    _calibrate(state)
                    _quantize(state)
                    _export(state)
                    result = _validate(state)
        except (UserError, PipelineError, Cancelled):
            raise
        except Exception as exc:
            logger.exception("pipeline failed")
            raise InternalError(f"internal error during {progress.current}: {exc}") from exc
        shutil.move(str(work.out), str(config.output_dir))
        if config.work_dir is not None:  # done: nothing is left to resume
            work.clear()
    result.output_dir = config.output_dir
    return result


def parity_reference(config: PipelineConfig) -> parity.Reference:
    """The BF16 merged model of ``config``'s base and adapter on the held-back examples and the
    adapter's task a run with ``config`` validates on: the side every checkpoint is measured against."""
    tokenizer = _tokenizer(config.base_dir)
    examples = _corpus(config, tokenizer).parity
    compute = device_mod.resolve(config.device)
    adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
    merged = MergedWeights(TensorSource(config.base_dir), adapter, compute.dtype, compute.device)
    model = streaming.build(read_config(config.base_dir), merged, compute, config.base_dir)
    return parity.reference_of(model, examples, config.continuation_tokens, task=_task_set(config, tokenizer, model))


def parity_of(config: PipelineConfig, checkpoint: Path, reference: parity.Reference | None = None) -> parity.Behaviour:
    """Parity of an existing ``checkpoint`` with the BF16 merged model of ``config``, and its task
    score (damage studies, audits); ``reference`` is ``parity_reference(config)`` where the caller
    measures several."""
    reference = reference or parity_reference(config)
    return parity.compare(reference, reader.load(checkpoint, device_mod.resolve(config.device)))


def _merge(state: _Run) -> None:
    """Plan the merge against the base (refusing what can't apply; nothing is merged until a layer's
    weights are read), build the streamed model, and check that memory and disk suffice."""
    config, compute = state.config, state.compute
    with state.progress.stage("merging"):
        base_config = read_config(config.base_dir)
        state.source = TensorSource(config.base_dir)
        state.adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
        state.merged = MergedWeights(state.source, state.adapter, compute.dtype, compute.device)
        state.progress.update(0.5)
        state.tokenizer = _tokenizer(config.base_dir)
        state.model = streaming.skeleton(base_config, state.merged, compute, config.base_dir)
        state.bf16_bytes = 2 * sum(state.merged.numel(n) for n in state.merged)
        tokens = _total_tokens(config)
        state.calibration_bytes = preflight.check_memory(
            state.model, state.merged, compute, tokens, state.recipe, config.sequence_length
        )
        hidden = int(state.model.config.hidden_size)
        preflight.check_disk(state.merged, state.recipe, state.work.root, config.output_dir, hidden, tokens)
        streaming.attach(state.model, state.merged, compute)


def _calibrate(state: _Run) -> None:
    """The corpus, then the recipe's calibration, layer by layer; or what an earlier run of the
    same inputs calibrated, from the work directory."""
    config, work = state.config, state.work
    with state.progress.stage("calibrating"):
        state.corpus = _corpus(config, state.tokenizer, state.progress.sub(0.0, 0.1))
        work.claim(fingerprint(config, state.compute, state.corpus.stats.calibration_sha256))
        assert state.merged is not None
        layers_name, modules = streaming.decoder_layers(state.model)
        layers, done = len(modules), work.calibrated.is_file()
        start = layers if done else work.resume_layer()
        if not done:
            work.forget_layers_from(start, layers_name)
        if state.recipe.mutates_weights:
            state.merged.keep_written(work.written)
        if done:
            saved = quantizers.restore(state.model, work.calibrated, state.compute)
            state.scales = state.session.keep_block_scales(state.model, work.block_scales)
            state.scales.finish()  # a state saved with its scales in it
            state.calibrated = Calibrated(
                saved["expert_tokens"], saved.get("fold_factors", {}), saved.get("expert_gptq", {}),
                [GroupError.from_list(row) for row in saved.get("rounding_errors", [])],
            )
            state.resumed_from = layers
            _note(config, f"Resuming: every layer was calibrated by an earlier run ({layers} layers)")
            return
        if start:
            state.resumed_from = start
            _note(config, f"Resuming calibration at layer {start + 1} of {layers}: an earlier run finished layers 1-{start}")
        state.scales = state.session.keep_block_scales(state.model, work.block_scales)
        # Validation's first round rides along where calibration walks every layer (not resumed).
        walk = None if start else first_round.prepare(
            state.model, state.corpus.parity, config.continuation_tokens,
            _task_set(config, state.tokenizer, state.model), state.calibration_bytes,
        )
        state.calibrated = calibrate(
            state.model, state.recipe, state.corpus.sequences, state.compute, state.session,
            state.progress.sub(0.1, 1.0), work, walk.layer if walk is not None else None,
        )
        state.scales.finish()
        state.first_round = walk.result() if walk is not None else None


def _quantize(state: _Run) -> None:
    """Fused projections share their global scales, the calibration is saved whole, and the
    quantizers compute as the checkpoint will."""
    work = state.work
    assert state.calibrated is not None and state.corpus is not None
    with state.progress.stage("quantizing"):
        if not work.calibrated.is_file():
            quantizers.share_fused_scales(state.model, state.merged)
            extra = {
                "expert_tokens": state.calibrated.expert_tokens, "fold_factors": state.calibrated.factors,
                "expert_gptq": state.calibrated.expert_gptq,
                "rounding_errors": [e.to_list() for e in state.calibrated.rounding_errors],
            }
            quantizers.save(state.model, work.calibrated, extra)
            work.calibration_done()
        quantizers.declared_inputs_only(state.model, state.recipe)
        state.session.use_checkpoint_numerics(state.model)


def _export(state: _Run) -> None:
    """The checkpoint, and the calibrated model's logits on one held-back example for the reload
    check, computed as export walks the layers (or by a forward of their own where a resumed run's
    export was already done)."""
    assert state.corpus is not None
    example = state.corpus.parity[0].input_ids[:RELOAD_CHECK_TOKENS]
    with state.progress.stage("exporting"):
        reference = _write_checkpoint(state, example) if not state.work.exported_mark.is_file() else None
        if reference is None:
            assert state.scales is not None
            with state.scales.in_forward():
                reference = parity.logits(state.model, example)
        state.reload = parity.Reload(reference, example)
        state.model = None
        if state.scales is not None:  # it refers to the model's layers, which must go now
            state.scales.close()
            state.scales = None
        memory.release(state.compute.device)


def _write_checkpoint(state: _Run, example: list[int]) -> torch.Tensor | None:
    """The export, and the reload check's reference computed in its walk. Nothing here outlives the
    call: the calibrated model must be unreferenced when the export is done, for the collection
    that frees it (its offload hooks make cycles)."""
    shutil.rmtree(state.work.out, ignore_errors=True)
    walk = ReloadReference(state.model, example)
    export(state.model, state.recipe, state.tokenizer, state.work.out, walk)
    state.work.exported_mark.touch()
    return walk.logits()


def _validate(state: _Run) -> PipelineResult:
    """The checkpoint's files, its independent reload, the adapter's change kept, and its behaviour
    against the BF16 merged model (and on the adapter's own task); then the quality gate."""
    config, recipe, compute, out = state.config, state.recipe, state.compute, state.work.out
    progress = state.progress
    assert state.corpus is not None and state.calibrated is not None and state.reload is not None
    with progress.stage("validating"):
        checks = structure.structure(out, recipe.format, state.bf16_bytes)
        candidate = reader.load(out, compute)
        progress.update(0.1)
        # The BF16 merged model again, merged from the base (cheap, deterministic; not the calibrated
        # model's map, whose changed weights are the checkpoint's), retention measured as it reads.
        assert state.source is not None
        merged = MergedWeights(state.source, state.adapter, compute.dtype, compute.device)
        dequantized = reader.DequantizedWeights(out, torch.float32, compute.device)
        kept_measure = retention.Retention(merged, dequantized, state.calibrated.factors) if merged.targets() else None
        merged.watch = kept_measure.observe if kept_measure is not None else None
        bf16_model = streaming.build(read_config(config.base_dir), merged, compute, config.base_dir)
        profiles = serving.profiles_to_measure(recipe.name, config.serving_hardware)
        # The BF16 side once (its continuations, hidden states and task score), then each candidate:
        # the checkpoint as declared, and as the engine computes it on each profile that differs.
        share = 0.9 / (len(profiles) + 2)
        bf16 = _bf16_side(state, bf16_model, progress.sub(0.1, 0.1 + share))
        merged.watch, state.first_round = None, None
        kept = kept_measure.report() if kept_measure is not None else None
        reload_diff, first = _behaviour(bf16, candidate, progress.sub(0.1 + share, 0.1 + 2 * share), state.reload)
        measured = [first]
        del candidate
        for i, (numerics, _) in enumerate(profiles, 2):
            there = reader.load(out, compute, numerics=numerics.key)
            measured.append(_behaviour(bf16, there, progress.sub(0.1 + i * share, 0.1 + (i + 1) * share))[1])
            del there
        del bf16_model, bf16
        (behaviour, task), thresholds = measured[0], config.thresholds or recipe.thresholds
        served = [
            ServingReport(
                numerics=numerics.key, description=numerics.description, hardware=hardware, parity=p, task=t,
                misses=gate.misses(thresholds, p, 0.0, None), as_declared_flag=numerics.as_declared_flag,
            )
            for (numerics, hardware), (p, t) in zip(profiles, measured[1:], strict=True)
        ]
        missed = gate.misses(thresholds, behaviour, reload_diff, kept)
        if missed and config.quality_gate:
            raise PipelineError("the checkpoint missed its quality thresholds: " + "; ".join(missed))
        assert state.reads is not None
        sizes = {"base": safetensors_bytes(config.base_dir), "checkpoint": safetensors_bytes(out)}
        held = {"written": state.work.written, "block_scales": state.work.block_scales}
        reads = state.reads.report({**sizes, **{name: safetensors_bytes(d) for name, d in held.items()}})
        result = PipelineResult(
            output_dir=out, quantization=recipe.name, stage_seconds=dict(progress.stage_seconds),
            bf16_bytes=state.bf16_bytes, output_bytes=directory_bytes(out), corpus=state.corpus.stats,
            parity=behaviour, reload_max_logit_diff=reload_diff, retention=kept,
            expert_tokens=state.calibrated.expert_tokens, expert_gptq=state.calibrated.expert_gptq, checks=checks, task=task, device=compute.describe(),
            quality_misses=missed, resumed_from_layer=state.resumed_from, serving=served, reads=reads,
        )
        result.checks += [f"reload matches the calibrated model (max logit difference {reload_diff:.4f})"]
        result.checks += report.headline(result.to_dict())
        model_card.write(out, model_card.lineage(config, recipe, result), result.to_dict())
    result.stage_seconds = dict(progress.stage_seconds)
    return result


def _bf16_side(state: _Run, bf16_model: Any, report: Callable[[float], None]) -> parity.Reference:
    """What the BF16 merged model does on the parity examples and the adapter's own task."""
    config = state.config
    assert state.corpus is not None
    task_set = _task_set(config, state.tokenizer, bf16_model)
    return parity.reference_of(
        bf16_model, state.corpus.parity, config.continuation_tokens, report, task_set, state.first_round
    )


def _task_set(config: PipelineConfig, tokenizer: Any, model: Any) -> task_mod.TaskSet | None:
    """The adapter's evaluation prompts (``config.eval_file``, else the adapter's own), if any."""
    return task_mod.of_adapter(config.eval_file, config.adapter_dir, tokenizer, parity.end_of_turn(model))


def _behaviour(
    bf16: parity.Reference, candidate: Any, report: Callable[[float], None], reload: parity.Reload | None = None
) -> tuple[float, tuple[ParityReport, TaskReport | None]]:
    """The reload difference (given ``reload``, else 0), parity with the BF16 merged model, and the
    adapter's own task on both, where it has one."""
    measured = parity.compare(bf16, candidate, report, reload)
    difference = measured.reload_difference or 0.0
    if bf16.task is None or measured.task_success is None:
        return difference, (measured.parity, None)
    task_report = TaskReport(prompts=len(bf16.task.prompts), bf16_success=bf16.task_success, quantized_success=measured.task_success)
    return difference, (measured.parity, task_report)


def _total_tokens(config: PipelineConfig) -> int:
    return max(config.calibration_tokens, 2 * config.user_token_minimum)


def _corpus(config: PipelineConfig, tokenizer: Any, report: Any = lambda f: None) -> corpus_mod.Corpus:
    """The calibration sequences and held-back parity examples ``config`` asks for."""
    return corpus_mod.build(
        tokenizer,
        calibration_file=config.calibration_file,
        general_text_file=config.general_text_file,
        total_tokens=_total_tokens(config),
        sequence_length=config.sequence_length,
        user_token_minimum=config.user_token_minimum,
        holdout_fraction=config.holdout_fraction,
        parity_prompts=config.parity_prompts,
        seed=config.seed,
        report=report,
    )


def _check_output_dir(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"output directory {path} already exists and is not empty")
    if path.exists():
        path.rmdir()


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
