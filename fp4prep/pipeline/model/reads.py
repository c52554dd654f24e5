"""Bytes a run reads from the base's weights, its checkpoint and the weights calibration wrote
back, by stage, as passes.

On a big base a job's time is the time to move its weights, so what a run reads is a figure it
reports: ``SafetensorsFile.read``, the byte copies of ``rewrite_safetensors`` and the written-back
store's ``load`` add what they read to the tally of the run in progress (a context variable, so
runs in other threads count apart). A pass is
the directory's safetensors bytes read once; 2.5 passes in validation means the stage read the
equivalent of the whole checkpoint two and a half times, page-cache hits included.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_TALLY: contextvars.ContextVar[ReadTally | None] = contextvars.ContextVar("fp4prep_read_tally", default=None)


def safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) if directory.is_dir() else 0


class ReadTally:
    """What one run read from each of ``sources`` (name -> directory), by the stage ``stage()`` names."""

    def __init__(self, sources: dict[str, Path], stage: Callable[[], str | None]) -> None:
        self.roots = {name: directory.resolve() for name, directory in sources.items()}
        self.stage = stage
        self.bytes: dict[str, dict[str, int]] = {name: {} for name in sources}
        self._owner: dict[Path, str | None] = {}

    def add(self, path: Path, n: int) -> None:
        parent = path.parent
        if parent not in self._owner:
            resolved = parent.resolve()
            self._owner[parent] = next((name for name, root in self.roots.items() if resolved == root), None)
        name = self._owner[parent]
        if name is not None:
            stage = self.stage() or "start"
            per_stage = self.bytes[name]
            per_stage[stage] = per_stage.get(stage, 0) + n

    def report(self, sizes: dict[str, int]) -> dict[str, Any]:
        """Per source: its size, the bytes each stage read, and both as passes (bytes / size)."""
        out: dict[str, Any] = {}
        for name, per_stage in self.bytes.items():
            size = sizes.get(name, 0)
            total = sum(per_stage.values())
            out[name] = {
                "size_bytes": size,
                "read_bytes": dict(per_stage),
                "passes": {stage: round(n / size, 2) if size else 0.0 for stage, n in per_stage.items()},
                "total_passes": round(total / size, 2) if size else 0.0,
            }
        return out


@contextmanager
def tallying(tally: ReadTally) -> Iterator[ReadTally]:
    """Count every tensor read inside the block into ``tally``."""
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def count(path: Path, n: int) -> None:
    tally = _TALLY.get()
    if tally is not None:
        tally.add(path, n)


def describe(report: dict[str, Any]) -> str:
    """A ``ReadTally.report`` in one line: ``base 4.01 passes (quantizing 0.99, ...); checkpoint ...``."""
    parts = []
    for name, side in report.items():
        if not side["read_bytes"]:
            continue
        stages = ", ".join(f"{stage} {passes:.2f}" for stage, passes in side["passes"].items())
        parts.append(f"{name} {side['total_passes']:.2f} passes ({stages})")
    return "; ".join(parts)
