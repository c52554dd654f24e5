"""The one entry point: ``run(config) -> result``, one function per stage.

merge -> calibrate -> quantize -> export -> validate, each stage reporting progress and checking for
cancellation and returning what the next one takes (``handoffs``), with one decoder layer's weights
in memory at a time: the merged model is a lazy map over the base's files (``model.merge``), read
layer by layer by a model whose weights live on the meta device (``model.streaming``); ModelOpt
calibrates it layer by layer (``calibrate``) and exports it shard by shard (``export``); the
reference and the checkpoint are both streamed again for validation (``validation.stage``).

What a run has finished is kept in its work directory (``workdir``), so a run that stops continues
from there. The checkpoint is moved into ``output_dir`` only after it passed validation, so a failed
or cancelled run leaves nothing half-written there.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import device as device_mod
from . import preflight
from .algorithms import held_gptq, held_scales
from .algorithms.mixed import GroupError
from .calibrate import CALIBRATION_BATCH, Calibrated, calibrate
from .config import PipelineConfig, PipelineResult
from .errors import Cancelled, InternalError, PipelineError, UserError
from .export import export
from .export import release as release_export
from .export.reference import ReloadReference
from .export.release import ReleaseWrite
from .handoffs import Base, CalibratedModel, Calibration, Merged, Run
from .inputs import corpus as corpus_mod
from .model import memory, streaming
from .model.merge import MergedWeights, load_adapter
from .model.reads import ReadTally, tallying
from .model.releases import BaseSource, QuantizedTensor
from .model.safetensors import read_config
from .modelopt_ext import quantizers
from .modelopt_ext.session import Session
from .progress import Progress
from .recipes import Gptq, Recipe, recipe_for
from .validation import first_round, parity, reader
from .validation.prompt_cache import FirstRun
from .validation.stage import task_set, validate
from .workdir import fingerprint, opened

logger = logging.getLogger(__name__)
RELOAD_CHECK_TOKENS = 128


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
        # The base, the checkpoint, and what the run keeps on disk until export reads it: the weights
        # calibration changed (one file each under written/) and the static block scales (one file
        # per layer under block_scales/).
        sources = {
            "base": config.base_dir, "checkpoint": work.out, "written": work.written, "block_scales": work.block_scales,
        }
        state = Run(config, recipe, progress, work, compute, Session(compute), ReadTally(sources, lambda: progress.current))
        try:
            with tallying(state.reads):
                merged = _merge(state)  # its checks before ModelOpt is imported (seconds): bad input fails at once
                with state.session:
                    release = merged.base.source.release
                    exported: parity.Reload | ReleaseWrite
                    if release is None:
                        calibration, exported = _calibrate_and_export(state, merged)
                    else:
                        calibration, exported = _prepare_release(state, merged)
                    base = merged.base
                    del merged  # the calibrated model goes with it: validation holds a layer at a time
                    memory.release(compute.device)
                    result = validate(state, base, calibration, exported)
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


def _calibrate_and_export(state: Run, merged: Merged) -> tuple[Calibration, parity.Reload]:
    """Calibrate, quantize and export ``merged``'s model. The calibrated model lives in this call
    only: it must be unreferenced when export is done, for the collection that frees it (its
    offload hooks make cycles)."""
    model, calibration = _calibrate(state, merged)
    _quantize(state, model, calibration)
    return calibration, _export(state, model, calibration.corpus, merged.base.tokenizer)


def _prepare_release(state: Run, merged: Merged) -> tuple[Calibration, ReleaseWrite]:
    """A base that ships in FP4: the prepared model is written in the release's own format, every
    tensor the adapter does not change copied from it, the changed weights rounded onto the
    release's block scales. No quantizer is calibrated: the release fixes the scales."""
    config, source = state.config, merged.base.source
    release = source.release
    assert release is not None  # the caller's branch: typed as optional on the source
    if state.recipe.format != release.format:
        raise UserError(
            f"the base is {release.format.name.upper()} release ({release.method}): a model prepared from it keeps "
            f"the release's format, so ask for {release.format.name}, not {state.recipe.format.name}"
        )
    progress, gptq = state.progress, state.recipe.gptq
    with progress.stage("calibrating"):
        corpus = _corpus(config, merged.base.tokenizer, progress.sub(0.0, 0.2 if gptq else 1.0))
        rounded, first = _round_on_release(state, merged, corpus, gptq, progress.sub(0.2, 1.0)) if gptq else (None, None)
    with progress.stage("quantizing"):
        progress.update(1.0)  # the release's scales are held: nothing to calibrate or fold

    def rounding(tensor: QuantizedTensor, weight: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        values = rounded.values(tensor) if rounded is not None else None
        return held_scales.nearest(weight, steps) if values is None else values.to(weight.device)

    with progress.stage("exporting"):
        shutil.rmtree(state.work.out, ignore_errors=True)
        written = release_export.write(source, merged.weights, state.work.out, rounding, progress.update)
    written.rounding = rounded.summary() if rounded is not None else {"rounding": "to nearest on the release's block scales"}
    return Calibration(corpus, Calibrated(expert_tokens={}, factors={}), None, first), written


def _round_on_release(
    state: Run, merged: Merged, corpus: corpus_mod.Corpus, gptq: Gptq, report: Callable[[float], None]
) -> tuple[held_gptq.HeldGptq, FirstRun | None]:
    """GPTQ with the release's scales held on the weights the adapter changes, on the Hessians of the
    BF16 merged model's inputs over the calibration corpus, walked one decoder layer at a time, and
    validation's first round on the same walk (the BF16 merged model is the one it runs)."""
    config, device = state.config, state.compute.device
    model = streaming.build(read_config(config.base_dir), merged.weights, state.compute, config.base_dir)
    batches = []
    for start in range(0, len(corpus.sequences), CALIBRATION_BATCH):
        ids = torch.tensor(corpus.sequences[start : start + CALIBRATION_BATCH], dtype=torch.long, device=device)
        batches.append((ids, torch.ones_like(ids)))
    walk = first_round.prepare(
        model, corpus.parity, config.continuation_tokens, task_set(config, merged.base.tokenizer, model), merged.calibration_bytes
    )
    rounded = held_gptq.round_release(
        model, batches, merged.base.source, merged.weights, state.work.release_codes, gptq.damp, gptq.hessian_stride, report,
        walk.layer if walk is not None else None,
    )
    return rounded, walk.result() if walk is not None else None


def parity_reference(config: PipelineConfig) -> parity.Reference:
    """The BF16 merged model of ``config``'s base and adapter on the held-back examples and the
    adapter's task a run with ``config`` validates on: the side every checkpoint is measured against."""
    tokenizer = _tokenizer(config.base_dir)
    examples = _corpus(config, tokenizer).parity
    compute = device_mod.resolve(config.device)
    adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
    merged = MergedWeights(BaseSource(config.base_dir), adapter, compute.dtype, compute.device)
    model = streaming.build(read_config(config.base_dir), merged, compute, config.base_dir)
    return parity.reference_of(model, examples, config.continuation_tokens, task=task_set(config, tokenizer, model))


def parity_of(config: PipelineConfig, checkpoint: Path, reference: parity.Reference | None = None) -> parity.Behaviour:
    """Parity of an existing ``checkpoint`` with the BF16 merged model of ``config``, and its task
    score (damage studies, audits); ``reference`` is ``parity_reference(config)`` where the caller
    measures several."""
    reference = reference or parity_reference(config)
    return parity.compare(reference, reader.load(checkpoint, device_mod.resolve(config.device)))


def _merge(state: Run) -> Merged:
    """Plan the merge against the base (refusing what can't apply; nothing is merged until a layer's
    weights are read), build the streamed model, and check that memory and disk suffice."""
    config, compute = state.config, state.compute
    with state.progress.stage("merging"):
        base_config = read_config(config.base_dir)
        source = BaseSource(config.base_dir)
        adapter = load_adapter(config.adapter_dir) if config.adapter_dir else None
        weights = MergedWeights(source, adapter, compute.dtype, compute.device)
        state.progress.update(0.5)
        tokenizer = _tokenizer(config.base_dir)
        model = streaming.skeleton(base_config, weights, compute, config.base_dir)
        tokens = _total_tokens(config)
        calibration_bytes = preflight.check_memory(
            model, weights, compute, tokens, state.recipe, config.sequence_length, release=source.release is not None
        )
        hidden = int(model.config.hidden_size)
        preflight.check_disk(weights, state.recipe, state.work.root, config.output_dir, hidden, tokens)
        streaming.attach(model, weights, compute)
        base = Base(source, adapter, tokenizer, bf16_bytes=2 * sum(weights.numel(n) for n in weights))
        return Merged(base, weights, model, calibration_bytes)


def _calibrate(state: Run, merged: Merged) -> tuple[CalibratedModel, Calibration]:
    """The corpus, then the recipe's calibration, layer by layer, with validation's first round in
    the same walk; or what an earlier run of the same inputs calibrated, from the work directory."""
    config, work, model = state.config, state.work, merged.model
    with state.progress.stage("calibrating"):
        corpus = _corpus(config, merged.base.tokenizer, state.progress.sub(0.0, 0.1))
        work.claim(fingerprint(config, state.compute, corpus.stats.calibration_sha256))
        layers_name, modules = streaming.decoder_layers(model)
        layers, done = len(modules), work.calibrated.is_file()
        start = layers if done else work.resume_layer()
        if not done:
            work.forget_layers_from(start, layers_name)
        if state.recipe.mutates_weights:
            merged.weights.keep_written(work.written)
        if done:
            saved = quantizers.restore(model, work.calibrated, state.compute)
            scales = state.session.keep_block_scales(model, work.block_scales)
            scales.finish()  # a state saved with its scales in it
            learned = Calibrated(
                saved["expert_tokens"], saved.get("fold_factors", {}), saved.get("expert_gptq", {}),
                [GroupError.from_list(row) for row in saved.get("rounding_errors", [])],
            )
            _note(config, f"Resuming: every layer was calibrated by an earlier run ({layers} layers)")
            return CalibratedModel(model, merged.weights, scales), Calibration(corpus, learned, layers, None)
        if start:
            _note(config, f"Resuming calibration at layer {start + 1} of {layers}: an earlier run finished layers 1-{start}")
        scales = state.session.keep_block_scales(model, work.block_scales)
        # Validation's first round rides along where calibration walks every layer (not resumed).
        walk = None if start else first_round.prepare(
            model, corpus.parity, config.continuation_tokens,
            task_set(config, merged.base.tokenizer, model), merged.calibration_bytes,
        )
        learned = calibrate(
            model, state.recipe, corpus.sequences, state.compute, state.session,
            state.progress.sub(0.1, 1.0), work, walk.layer if walk is not None else None,
        )
        scales.finish()
        first = walk.result() if walk is not None else None
        return CalibratedModel(model, merged.weights, scales), Calibration(corpus, learned, start or None, first)


def _quantize(state: Run, calibrated: CalibratedModel, calibration: Calibration) -> None:
    """Fused projections share their global scales, the calibration is saved whole, and the
    quantizers compute as the checkpoint will."""
    work, model, learned = state.work, calibrated.model, calibration.learned
    with state.progress.stage("quantizing"):
        if not work.calibrated.is_file():
            quantizers.share_fused_scales(model, calibrated.weights)
            extra = {
                "expert_tokens": learned.expert_tokens, "fold_factors": learned.factors, "expert_gptq": learned.expert_gptq,
                "rounding_errors": [e.to_list() for e in learned.rounding_errors],
            }
            quantizers.save(model, work.calibrated, extra)
            work.calibration_done()
        quantizers.declared_inputs_only(model, state.recipe)
        state.session.use_checkpoint_numerics(model)


def _export(state: Run, calibrated: CalibratedModel, corpus: corpus_mod.Corpus, tokenizer: Any) -> parity.Reload:
    """The checkpoint, and the reload check's reference: the calibrated model's logits on one
    held-back example, computed as export walks the layers (or by a forward of their own where a
    resumed run's export was already done). The model's block scales are closed at the end."""
    example = corpus.parity[0].input_ids[:RELOAD_CHECK_TOKENS]
    with state.progress.stage("exporting"):
        if not state.work.exported_mark.is_file():
            shutil.rmtree(state.work.out, ignore_errors=True)
            walk = ReloadReference(calibrated.model, example)
            export(calibrated.model, state.recipe, tokenizer, state.work.out, walk)
            state.work.exported_mark.touch()
            reference = walk.logits()
            del walk
        else:
            reference = None
        if reference is None:
            with calibrated.scales.in_forward():
                reference = parity.logits(calibrated.model, example)
        calibrated.scales.close()  # it refers to the model's layers
        return parity.Reload(reference, example)


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
