"""Elementwise quantization compiled into one loop for CPU tensors.

In eager torch a quantize-dequantize is a dozen passes over the tensor and costs as much as the
matmul it feeds; compiled by TorchInductor it is ~10x faster, with the same values (rounding,
division and the E4M3 cast are elementwise and kept; block maxima are exact whatever the order).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)
R = TypeVar("R")

# Below this many values eager torch takes a few milliseconds at most: not worth a compile (which a
# fresh worker process pays again, from the on-disk cache, for every shape family it meets).
MIN_VALUES = 1 << 18


# Graphs one function may compile (torch's default is 8): one per width and dtype it meets, and a
# big MoE base has a dozen widths.
GRAPHS = 64


class Compiled(Generic[R]):
    """``fn`` compiled for CPU tensors of at least ``min_values`` values, eager everywhere else.

    With ``rows_vary``, only the dimensions of ``x`` before its last are compiled as sizes that
    vary; its width, dtype, the other tensors' shapes and the integers are fixed per graph, one
    compile for each that the run meets. A loop over blocks of a known width is vectorized; with
    every size symbolic it is not (an NVFP4 activation of 2048 × 576 in BF16: 27 ms against 2.8).
    Otherwise every size is symbolic: one graph, for arguments whose shapes all vary together.

    With ``compile_after``, the first that many calls (of at least ``min_values``) in a process run
    eager: for a function whose compile costs more than a small job's eager calls do. ``eager``, if
    given, is what runs uncompiled: the same values as ``fn`` in fewer operations, where the form that
    compiles best is not the one that runs best in eager torch.

    Where compilation fails (no C++ compiler) the eager function runs, with a warning the first
    time; ``FP4PREP_COMPILE=0`` asks for eager torch throughout. Compiling changes speed, never a
    value: the compiled function is a cache of this process, like torch's own.
    """

    def __init__(
        self, fn: Callable[..., R], min_values: int = MIN_VALUES, rows_vary: bool = False, compile_after: int = 0,
        eager: Callable[..., R] | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.eager = eager or fn
        self.min_values = min_values
        self.rows_vary = rows_vary
        self.compile_after = compile_after
        self.eager_calls = 0
        self.available = True
        self._compiled: Callable[..., R] | None = None

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> R:
        wanted = os.environ.get("FP4PREP_COMPILE", "1") != "0"
        if not (wanted and self.available) or x.device.type != "cpu" or x.numel() < self.min_values:
            return self.eager(x, *args, **kwargs)
        if self.eager_calls < self.compile_after:
            self.eager_calls += 1
            return self.eager(x, *args, **kwargs)
        import torch._dynamo.config
        import torch._inductor.config

        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=not self.rows_vary)
        if self.rows_vary:
            x = x.view(x.shape)  # marked, not the caller's tensor
            for dim in range(x.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(x, dim)
        try:
            # Compiled in this process (no pool of compiler processes beside a busy worker), with
            # torch's own settings left as they were.
            with torch._inductor.config.patch(compile_threads=1), torch._dynamo.config.patch(recompile_limit=GRAPHS):
                return self._compiled(x, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager path is correct
            self.available = False
            logger.warning("compiled quantization unavailable (%s); running %s in eager torch", exc, self.eager.__name__)
            return self.eager(x, *args, **kwargs)


def compiled(fn: Callable[..., R] | None = None, *, min_values: int = MIN_VALUES, rows_vary: bool = False) -> Any:
    """Decorator form of ``Compiled``: ``@compiled`` or ``@compiled(min_values=..., rows_vary=...)``."""
    if fn is None:
        return lambda f: Compiled(f, min_values, rows_vary)
    return Compiled(fn, min_values, rows_vary)
