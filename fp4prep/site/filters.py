"""Template filters every page has (a builtin library): sizes are written as everywhere else."""

from __future__ import annotations

from django import template

from fp4prep.text import format_bytes

register = template.Library()


@register.filter(name="bytes")
def bytes_filter(n: int | float | None) -> str:
    """``{{ size|bytes }}``: ``512 bytes``, ``64 MiB``, ``1.5 GiB``."""
    return "" if n is None else format_bytes(n)
