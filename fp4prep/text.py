"""Showing user-supplied values back to users: always short, whatever was sent."""

from __future__ import annotations

import re
from typing import Any

EXCERPT_CHARS = 40


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how much was left out.

    Error messages quote what was wrong; a 2 MiB value must not become a 2 MiB answer (nor be
    stored in a report that every listing repeats).
    """
    return clip(repr(value), limit)


def clip(text: str, limit: int = 120) -> str:
    """``text`` itself, cut to ``limit`` characters the same way."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units, as people read them: ``512 bytes``, ``64 MiB``, ``1.5 GiB``."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            value = f"{n / factor:.1f}".removesuffix(".0")
            return f"{value} {unit}"
    return f"{int(n):,} bytes"


_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.@%+=,~-]+/)+([\w.@%+=,~-]+)")


def without_paths(text: str) -> str:
    """``text`` with absolute file paths cut to their last part: a message for a customer names the
    file (``calibrated.pt``), never where the service keeps it."""
    return _PATH.sub(r"\1", text)
