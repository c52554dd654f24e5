"""Typed input and output of ``run``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .progress import CancelCheck, NoteCallback, ProgressCallback

if TYPE_CHECKING:
    from .recipes import Recipe, Thresholds

# Beside the adapter: JSONL of {"messages", "expected"}, the adapter's own task.
EVAL_FILE = "fp4prep_eval.jsonl"


@dataclass
class PipelineConfig:
    """Everything one preparation run needs. Paths are local directories or files."""

    base_dir: Path
    output_dir: Path
    quantization: str = "nvfp4"
    adapter_dir: Path | None = None
    calibration_file: Path | None = None
    # General text: a .txt file (blank-line separated documents) or a JSONL of {"text": ...};
    # None uses the embedded offline default.
    general_text_file: Path | None = None
    # JSONL of {"messages", "expected"}: the adapter's task, scored on BF16 and quantized models.
    # None looks for fp4prep_eval.jsonl in the adapter directory.
    eval_file: Path | None = None
    calibration_tokens: int = 8192  # both halves together
    sequence_length: int = 512
    user_token_minimum: int = 0
    holdout_fraction: float = 0.1
    parity_prompts: int = 16
    continuation_tokens: int = 16
    seed: int = 0
    # auto (the first CUDA device when there is one), cpu, cuda or cuda:N.
    device: str = "auto"
    # Where the run keeps what lets it resume (calibrated layers, the export): a run with the same
    # inputs and the same work_dir continues where the last one stopped. None: a temporary
    # directory beside output_dir, removed at the end.
    work_dir: Path | None = None
    # False: a checkpoint that misses its thresholds is still written; each miss is reported in
    # the result and in fp4prep.json.
    quality_gate: bool = True
    # Shown in the model card: base and adapter IDs, revision, job, ...
    lineage: dict[str, Any] = field(default_factory=dict)
    thresholds: Thresholds | None = None  # None: the recipe's own
    # The GPUs the checkpoint will be served on (deployment profiles' hardware, e.g. "NVIDIA B200"):
    # where the engine computes there other than what the checkpoint declares (MXFP4 on Blackwell),
    # the checkpoint is measured once more as it will run there.
    serving_hardware: list[str] = field(default_factory=list)
    # A recipe other than the format's own (the recipe benchmarks try candidates); None: the
    # format's recipe, which is what every hosted job and the local command use.
    recipe: Recipe | None = None
    progress: ProgressCallback | None = None
    should_cancel: CancelCheck | None = None
    notify: NoteCallback | None = None  # one-line news worth telling the user (a resumed run)

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir)
        self.output_dir = Path(self.output_dir)
        for name in ("adapter_dir", "calibration_file", "general_text_file", "eval_file", "work_dir"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))


@dataclass(frozen=True)
class RunSettings:
    """The ``PipelineConfig`` fields a catalogue entry fixes for every job on its base (users can't
    change them); None leaves the config's default. ``parse`` checks an entry's JSON before it is
    saved, so an entry that can't run is refused with the field named, not found when a job runs."""

    calibration_tokens: int | None = None
    sequence_length: int | None = None
    holdout_fraction: float | None = None
    parity_prompts: int | None = None
    continuation_tokens: int | None = None
    seed: int | None = None
    thresholds: Thresholds | None = None

    @classmethod
    def parse(cls, raw: object, where: str = "run_settings") -> RunSettings:
        """``raw`` (a JSON object) as settings; ValueError naming the field (``where.key``) otherwise."""
        from .recipes import Thresholds

        if not isinstance(raw, dict):
            raise ValueError(f"{where}: must be a JSON object, not {type(raw).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: not a setting a catalogue entry fixes; those are {', '.join(known)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "thresholds":
                values[name] = Thresholds(**_thresholds(value, f"{where}.thresholds"))
            elif name == "holdout_fraction":
                values[name] = _number(value, f"{where}.{name}", inside=(0.0, 1.0))
            else:
                values[name] = _count(value, f"{where}.{name}", minimum=0 if name == "seed" else 1)
        return cls(**values)

    def config_fields(self) -> dict[str, Any]:
        """The settings given, as ``PipelineConfig`` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _count(value: object, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: must be a whole number, not {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: must be at least {minimum}, not {value}")
    return value


def _number(value: object, where: str, *, inside: tuple[float, float] | None = None) -> float:
    """A finite number, at least 0 (or strictly inside ``inside``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, not {value!r}")
    if inside is not None and not inside[0] < value < inside[1]:
        raise ValueError(f"{where}: must be between {inside[0]} and {inside[1]}, not {value}")
    if inside is None and value < 0:
        raise ValueError(f"{where}: must be at least 0, not {value}")
    return float(value)


def _thresholds(value: object, where: str) -> dict[str, float]:
    from .recipes import Thresholds

    names = [f.name for f in fields(Thresholds)]
    if not isinstance(value, dict) or set(value) != set(names):
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{where}: must be an object with exactly the keys {', '.join(names)}, not {keys}")
    return {name: _number(value[name], f"{where}.{name}") for name in names}


@dataclass
class CorpusStats:
    user_tokens: int
    general_tokens: int
    conversations: int
    held_out_conversations: int
    sequences: int
    calibration_sha256: str | None


@dataclass
class ParityReport:
    """Behaviour of the quantized checkpoint against the BF16 merged model, teacher-forced over
    whole held-back conversations, over their assistant turns, and over the BF16 model's own
    greedy continuations; and by decoding (identical greedy continuations)."""

    prompts: int
    tokens: int
    top1_agreement: float
    mean_kl: float
    identical_greedy: float
    answer_tokens: int
    answer_top1: float
    answer_kl: float
    continuation_tokens: int
    continuation_top1: float
    continuation_kl: float


@dataclass
class RetentionReport:
    """How much of the adapter's change survived quantization, per quantized tensor."""

    pooled: float
    minimum: float
    median: float
    per_tensor: dict[str, float]


@dataclass
class TaskReport:
    """The adapter's own task, scored on the BF16 merged model and on the checkpoint."""

    prompts: int
    bf16_success: float
    quantized_success: float


@dataclass
class ServingReport:
    """The checkpoint measured as the engine runs it on some of its deployment hardware, where that
    differs from what the checkpoint declares (see ``serving``)."""

    numerics: str  # serving.EngineNumerics.key
    description: str
    hardware: list[str]
    parity: ParityReport
    task: TaskReport | None
    # The recipe's thresholds this numerics misses (the quality gate applies to the declared one).
    misses: list[str]
    # vLLM's setting that runs the checkpoint as declared on that hardware instead.
    as_declared_flag: str


@dataclass
class PipelineResult:
    output_dir: Path
    quantization: str
    stage_seconds: dict[str, float]
    bf16_bytes: int
    output_bytes: int
    corpus: CorpusStats
    parity: ParityReport
    reload_max_logit_diff: float
    retention: RetentionReport | None
    expert_tokens: dict[str, list[int]]
    checks: list[str]
    # Per routed-expert module: [projections GPTQ rounded, projections that kept max calibration
    # because fewer tokens reached them than their input width]; empty without GPTQ.
    expert_gptq: dict[str, list[int]] = field(default_factory=dict)
    task: TaskReport | None = None
    device: str = "cpu"
    # Thresholds the checkpoint missed; empty unless the quality gate was off.
    quality_misses: list[str] = field(default_factory=list)
    # The decoder layer calibration resumed from, when an earlier run had got that far.
    resumed_from_layer: int | None = None
    # Behaviour where the serving hardware computes other than the checkpoint declares.
    serving: list[ServingReport] = field(default_factory=list)
    # What the run read from the base's weights and from its checkpoint, by stage and as passes
    # ({"base": {"size_bytes", "read_bytes": {stage: n}, "passes": {stage: x}, "total_passes"}, ...}).
    reads: dict[str, Any] = field(default_factory=dict)
    # Where the base is an FP4 release and the model is written in its format: how many stored
    # tensors were copied from it byte for byte, how many quantized weights got new codes on its
    # scales, and how many tensors it keeps unquantized were written merged; how the changed weights
    # were rounded, the share of their change in the outputs kept, and the weights that kept too little.
    release: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_dir"] = str(self.output_dir)
        return data
