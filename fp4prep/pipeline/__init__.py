"""The FP4 preparation pipeline. No Django here: the service calls ``run`` from its workers.

Names are imported on first use (PEP 562) so that the light modules (``errors``, ``recipes``,
``formats``, ``inputs``, ``validation.report``) can be used by the web process without importing
torch, transformers or ModelOpt.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import CorpusStats, ParityReport, PipelineConfig, PipelineResult, RetentionReport
    from .errors import Cancelled, PipelineError, UserError
    from .progress import STAGES
    from .recipes import RECIPES, Thresholds
    from .stages import run

_WHERE = {
    "CorpusStats": "config",
    "ParityReport": "config",
    "PipelineConfig": "config",
    "PipelineResult": "config",
    "RetentionReport": "config",
    "Cancelled": "errors",
    "PipelineError": "errors",
    "UserError": "errors",
    "STAGES": "progress",
    "RECIPES": "recipes",
    "Thresholds": "recipes",
    "run": "stages",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
