"""Progress reporting and cancellation between and inside the pipeline's stages."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import Cancelled

STAGES = ("merging", "calibrating", "quantizing", "exporting", "validating")

ProgressCallback = Callable[[str, float], None]
CancelCheck = Callable[[], bool]
NoteCallback = Callable[[str], None]


@dataclass
class Progress:
    """Tells the caller which stage runs and how far it got, and asks whether to stop.

    ``update`` is cheap: call it inside long loops. It checks for cancellation on every call.
    """

    callback: ProgressCallback | None = None
    should_cancel: CancelCheck | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    current: str | None = None

    def check(self) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise Cancelled(f"cancelled during {self.current or 'start-up'}")

    def update(self, fraction: float) -> None:
        self.check()
        if self.callback is not None and self.current is not None:
            self.callback(self.current, min(max(fraction, 0.0), 1.0))

    @contextmanager
    def stage(self, name: str) -> Iterator[Progress]:
        self.current = name
        self.update(0.0)
        started = time.perf_counter()
        try:
            yield self
        finally:
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + (time.perf_counter() - started)
        self.update(1.0)

    def sub(self, start: float, end: float) -> Callable[[float], None]:
        """A fraction reporter for one part of the current stage, mapped into [start, end]."""
        return lambda f: self.update(start + (end - start) * f)
