"""The validation stage: the checkpoint's files, its independent reload, the adapter's change kept,
its behaviour against the BF16 merged model (and on the adapter's own task) as declared and as the
engine computes it where the serving hardware differs; then the quality gate and the report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import serving
from ..config import ParityReport, PipelineConfig, PipelineResult, ServingReport, TaskReport
from ..errors import PipelineError
from ..export import model_card
from ..export.release import ReleaseWrite, digest
from ..handoffs import Base, Calibration, Run
from ..model import streaming
from ..model.merge import MergedWeights
from ..model.reads import safetensors_bytes
from ..model.safetensors import directory_bytes, read_config
from . import gate, parity, reader, report, retention, structure
from . import task as task_mod


def validate(state: Run, base: Base, calibration: Calibration, exported: parity.Reload | ReleaseWrite) -> PipelineResult:
    """The checkpoint's files and independent reload (see ``_files``), the adapter's change kept, and
    its behaviour against the BF16 merged model (and on the adapter's own task), starting from
    ``calibration``'s first round; then the quality gate."""
    config, recipe, compute, out = state.config, state.recipe, state.compute, state.work.out
    progress, learned = state.progress, calibration.learned
    with progress.stage("validating"):
        checks, reload = _files(state, base, exported)
        candidate = reader.load(out, compute)
        progress.update(0.1)
        # The BF16 merged model again, merged from the base (cheap, deterministic; not the calibrated
        # model's map, whose changed weights are the checkpoint's), retention measured as it reads.
        merged = MergedWeights(base.source, base.adapter, compute.dtype, compute.device)
        dequantized = reader.DequantizedWeights(out, torch.float32, compute.device)
        kept_measure = retention.Retention(merged, dequantized, learned.factors) if merged.targets() else None
        merged.watch = kept_measure.observe if kept_measure is not None else None
        bf16_model = streaming.build(read_config(config.base_dir), merged, compute, config.base_dir)
        profiles = serving.profiles_to_measure(recipe.name, config.serving_hardware, bool(learned.expert_tokens))
        # The BF16 side once (its continuations, hidden states and task score), then each candidate:
        # the checkpoint as declared, and as the engine computes it on each profile that differs.
        share = 0.9 / (len(profiles) + 2)
        bf16 = bf16_side(config, base, calibration, bf16_model, progress.sub(0.1, 0.1 + share))
        merged.watch, calibration.first_round = None, None
        kept = kept_measure.report() if kept_measure is not None else None
        reload_diff, first = measure(bf16, candidate, progress.sub(0.1 + share, 0.1 + 2 * share), reload)
        measured = [first]
        del candidate
        for i, (numerics, _) in enumerate(profiles, 2):
            there = reader.load(out, compute, numerics=numerics.key)
            measured.append(measure(bf16, there, progress.sub(0.1 + i * share, 0.1 + (i + 1) * share))[1])
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
        missed = gate.held(thresholds, behaviour, reload_diff, kept, served, recipe.name, config.serving_hardware)
        if missed and config.quality_gate:
            raise PipelineError("the checkpoint missed its quality thresholds: " + "; ".join(missed))
        sizes = {"base": safetensors_bytes(config.base_dir), "checkpoint": safetensors_bytes(out)}
        held = {"written": state.work.written, "block_scales": state.work.block_scales}
        reads = state.reads.report({**sizes, **{name: safetensors_bytes(d) for name, d in held.items()}})
        result = PipelineResult(
            output_dir=out, quantization=recipe.name, stage_seconds=dict(progress.stage_seconds),
            bf16_bytes=base.bf16_bytes, output_bytes=directory_bytes(out), corpus=calibration.corpus.stats,
            parity=behaviour, reload_max_logit_diff=reload_diff, retention=kept,
            expert_tokens=learned.expert_tokens, expert_gptq=learned.expert_gptq, checks=checks, task=task,
            device=compute.describe(), quality_misses=missed, resumed_from_layer=calibration.resumed_from,
            serving=served, reads=reads, release=exported.summary() if isinstance(exported, ReleaseWrite) else None,
        )
        if reload is not None:
            result.checks += [f"reload matches the calibrated model (max logit difference {reload_diff:.4f})"]
        result.checks += report.headline(result.to_dict())
        model_card.write(out, model_card.lineage(config, recipe, result), result.to_dict())
    result.stage_seconds = dict(progress.stage_seconds)
    return result


def _files(state: Run, base: Base, exported: parity.Reload | ReleaseWrite) -> tuple[list[str], parity.Reload | None]:
    """The checkpoint's files checked (against the release it was written in the format of, when it
    was), and the reload to compare the candidate with (none for a release: its changed weights are
    checked as written)."""
    out, compute = state.work.out, state.compute
    if isinstance(exported, ReleaseWrite):
        checks = structure.same_as_release(out, base.source.directory, base.bf16_bytes)
        return [*checks, _reload_as_written(out, exported, compute)], None
    return structure.structure(out, state.recipe.format, base.bf16_bytes), exported


def bf16_side(
    config: PipelineConfig, base: Base, calibration: Calibration, bf16_model: Any, report: Callable[[float], None]
) -> parity.Reference:
    """What the BF16 merged model does on the parity examples and the adapter's own task, from the
    first round calibration's walk ran where it did."""
    tasks = task_set(config, base.tokenizer, bf16_model)
    return parity.reference_of(
        bf16_model, calibration.corpus.parity, config.continuation_tokens, report, tasks, calibration.first_round
    )


def task_set(config: PipelineConfig, tokenizer: Any, model: Any) -> task_mod.TaskSet | None:
    """The adapter's evaluation prompts (``config.eval_file``, else the adapter's own), if any."""
    return task_mod.of_adapter(config.eval_file, config.adapter_dir, tokenizer, parity.end_of_turn(model))


def measure(
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


def _reload_as_written(out: Path, written: ReleaseWrite, compute: Any) -> str:
    """The independent reader decodes every weight the writer changed to exactly what it wrote."""
    weights = reader.DequantizedWeights(out, torch.float32, compute.device)
    for name, expected in written.digests.items():
        if digest(weights.stored(name)) != expected:
            raise PipelineError(f"{name} does not read back as it was written")
    return (
        f"reload: the {len(written.digests)} tensors the adapter changed read back bit for bit as written; "
        f"{written.copied} tensors copied from the release byte for byte"
    )
