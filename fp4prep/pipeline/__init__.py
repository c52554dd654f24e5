"""The FP4 preparation pipeline. No Django here: the service calls ``run`` from its workers.

Names are imported on first use (PEP 562) so that light modules (``errors``, ``conversations``)
can be used by the web process without importing torch, transformers or ModelOpt.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import CorpusStats, ParityReport, PipelineConfig, PipelineResult, RetentionReport
    from .errors import Cancelled, PipelineError, UserError
    from .progress import STAGES
    from .recipes import RECIPES, Thresholds
    from .runner import run

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
    "run": "runner",
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
    # Importing the submodule ``run`` binds the module to this name; the function must win, as it
    # did with an eager ``from .runner import run``.
    globals()[name] = value
    return value
