"""The FP4 preparation pipeline. No Django here: the service calls ``run`` from its workers."""

from .config import CorpusStats, ParityReport, PipelineConfig, PipelineResult, RetentionReport
from .errors import Cancelled, PipelineError, UserError
from .progress import STAGES
from .recipes import RECIPES, Thresholds
from .run import run

__all__ = [
    "RECIPES",
    "STAGES",
    "Cancelled",
    "CorpusStats",
    "ParityReport",
    "PipelineConfig",
    "PipelineError",
    "PipelineResult",
    "RetentionReport",
    "Thresholds",
    "UserError",
    "run",
]
