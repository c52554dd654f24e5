"""How the CLI talks to people: tables, amounts, times, confirmation, a stage progress bar."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from fp4prep.text import format_bytes


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def facts(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {'' if v is None else v}" for k, v in pairs)


def usd(amount: float) -> str:
    return f"${amount:,.2f}"


def hours(value: float) -> str:
    """Hours as "about 6.0h"; two decimals below an hour so a short job isn't 0.1h."""
    return f"{value:.1f}h" if value >= 1 else f"{value:.2f}h"


def when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else ""


def size(n: int) -> str:
    return format_bytes(n)


def dump(raw: Any) -> None:
    print(json.dumps(raw, indent=2, sort_keys=True))


def interactive() -> bool:
    """Prompts only for a person at a terminal: never with redirected input or output, nor in CI."""
    return sys.stdin.isatty() and sys.stdout.isatty() and not os.environ.get("CI")


def confirm(question: str) -> bool:
    try:
        return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}
    except EOFError:
        return False


class StageBar:
    """The running job's stage as a progress bar on stderr, when stderr is a terminal."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self.stage = ""
        self.bar: Any = None

    def update(self, stage: str, fraction: float) -> None:
        if not self.enabled or not stage:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=100, desc=f"{stage:<12}", file=sys.stderr, ncols=64, bar_format="{desc} {bar} {percentage:3.0f}%")
        self.bar.update(max(0, round(fraction * 100) - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.stage = ""
