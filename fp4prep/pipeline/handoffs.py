"""What the stages hand each other, typed: each stage of ``stages`` returns what the next one
takes. Calibration's walk also runs validation's first round of checking, and export's walk computes
the reload check's reference: both show here, in ``Calibration`` and in export's ``parity.Reload``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .calibrate import Calibrated
    from .config import PipelineConfig
    from .device import Compute
    from .inputs.corpus import Corpus
    from .model.merge import Adapter, MergedWeights
    from .model.reads import ReadTally
    from .model.releases import BaseSource
    from .modelopt_ext.block_scales import BlockScales
    from .modelopt_ext.session import Session
    from .progress import Progress
    from .recipes import Recipe
    from .validation.prompt_cache import FirstRun
    from .workdir import WorkDir


@dataclass(frozen=True)
class Run:
    """What every stage of one run takes: its inputs and the machinery they share."""

    config: PipelineConfig
    recipe: Recipe
    progress: Progress
    work: WorkDir
    compute: Compute
    session: Session
    reads: ReadTally


@dataclass(frozen=True)
class Base:
    """The base and the adapter as the merge planned them: what validation merges again for the
    BF16 side."""

    source: BaseSource
    adapter: Adapter | None
    tokenizer: Any
    bf16_bytes: int  # the merged model's weights in BF16


@dataclass(frozen=True)
class Merged:
    """The merge stage's result: the merged model, streamed a layer at a time from the base."""

    base: Base
    weights: MergedWeights
    model: Any  # the streamed model, its weights read through ``weights``
    calibration_bytes: int  # what calibrating one layer needs on the device (``preflight``)


@dataclass(frozen=True)
class CalibratedModel:
    """The model ModelOpt calibrated, with its block scales kept on disk between uses: what the
    quantize stage finishes and the export stage writes and then frees."""

    model: Any
    weights: MergedWeights
    scales: BlockScales


@dataclass
class Calibration:
    """What calibrating leaves for validation: the corpus, what the recipe learned, and validation's
    first round of checking where it ran in calibration's walk of the layers (not on a resume).
    Validation drops the first round once the BF16 side has used it: its states and keys and
    values would otherwise stay in memory through every candidate's checking."""

    corpus: Corpus
    learned: Calibrated
    resumed_from: int | None
    first_round: FirstRun | None
