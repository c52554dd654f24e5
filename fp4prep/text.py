"""User-supplied text: read as JSON with every failure a short reason, and shown back short,
whatever was sent."""

from __future__ import annotations

import json
import re
import sys
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


class _Constant(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise _Constant(f"{name} is not a JSON number")


def parse_json(data: str | bytes, *, constants: bool = True) -> Any:
    """``json.loads`` for what users send: whatever is wrong is a ``ValueError`` with a short reason.

    ``json`` raises other errors for two inputs that are merely bad: nesting past Python's
    recursion limit (``RecursionError``) and an integer past ``sys.get_int_max_str_digits`` digits
    (a ``ValueError`` whose text tells the reader to change an interpreter setting). Without
    ``constants``, ``NaN`` and ``Infinity`` (which ``json`` accepts, and JSON does not have) are
    refused too.
    """
    try:
        return json.loads(data) if constants else json.loads(data, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
        raise ValueError(f"{exc.msg} at {where}") from None
    except _Constant as exc:
        raise ValueError(str(exc)) from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:
        if "digits" not in str(exc):  # json raises nothing else as a bare ValueError today
            raise ValueError(clip(str(exc), 80)) from None
        raise ValueError(f"a number has more than {sys.get_int_max_str_digits():,} digits") from None
