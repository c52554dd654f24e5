"""An adapter config's ``rank_pattern`` / ``alpha_pattern``: which rank and alpha each module gets.

Their keys are regular expressions that PEFT matches against the end of a module's dotted name,
the first key that matches giving the value. Most are plain module names
(``layers.3.self_attn.q_proj``), looked up here by form rather than matched one by one. The rest
are matched with the ``regex`` engine: Python's ``re`` backtracks exponentially on patterns such
as ``(.*.*)*Z``, holding the GIL for hours, while ``regex`` handles those in linear time, under a
per-match timeout for whatever is left. What matching would cost is counted before it starts.
"""

from __future__ import annotations

import re
from typing import Any

import regex

from fp4prep.text import excerpt

from ..errors import UserError

CONFIG_NAME = "adapter_config.json"
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")
PATTERN_MAX_CHARS = 256
PATTERN_MAX_KEYS = 4096
PATTERN_MAX_EXPRESSIONS = 256  # keys that are regular expressions rather than plain module names
# The upload's default bound on forms of plain keys plus regular expressions, times modules: each
# step is one lookup or one match.
PATTERN_MAX_STEPS = 200_000
MATCH_TIMEOUT_SECONDS = 0.05
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.]+")


class _PlainKeys:
    """The keys made of letters, digits, ``_`` and ``.`` only, looked up rather than matched.

    As a regular expression such a key matches exactly the last ``len(key)`` characters of a module
    name (each ``.`` any one character), preceded by a ``.`` or by nothing. So keys are grouped by
    their form (length and where their dots are), and within a form by the characters between the
    dots: one dictionary lookup per form answers for all its keys, however many there are.
    """

    def __init__(self) -> None:
        self.forms: dict[tuple[int, tuple[tuple[int, int], ...]], dict[str, int]] = {}

    def add(self, order: int, key: str) -> None:
        chunks, start = [], 0
        for i, c in enumerate(key + "."):
            if c == ".":
                if i > start:
                    chunks.append((start, i))
                start = i + 1
        spans = tuple(chunks)
        self.forms.setdefault((len(key), spans), {}).setdefault("".join(key[a:b] for a, b in spans), order)

    def first(self, module: str) -> int | None:
        """The order of the first key that matches ``module``, if any does."""
        best = None
        for (n, spans), table in self.forms.items():
            if len(module) < n or (len(module) > n and module[-n - 1] != "."):
                continue
            tail = module[-n:]
            order = table.get("".join(tail[a:b] for a, b in spans))
            if order is not None and (best is None or order < best):
                best = order
        return best


class Patterns:
    """One ``rank_pattern`` / ``alpha_pattern`` field, its keys compiled once.

    Plain keys (module names such as ``layers.3.self_attn.q_proj``, as PEFT writes them) are looked
    up by form; other keys are matched one by one. What matching costs is the number of forms and
    regular expressions times the number of modules: ``check_cost`` refuses more than a bound
    before anything is matched.
    """

    def __init__(self, config: dict[str, Any], field: str) -> None:
        self.field = field
        items = list((config.get(field) or {}).items())
        self.values = [value for _, value in items]
        self.plain = _PlainKeys()
        expressions: list[tuple[int, str]] = []
        for order, (key, _) in enumerate(items):
            if _PLAIN_KEY.fullmatch(key):
                self.plain.add(order, key)
            else:
                expressions.append((order, key))
        if len(expressions) > PATTERN_MAX_EXPRESSIONS:  # before compiling any: each takes about half a millisecond
            raise UserError(
                f"{CONFIG_NAME}: {field} has {len(expressions):,} keys that are regular expressions; at most "
                f"{PATTERN_MAX_EXPRESSIONS} are accepted (plain module names such as 'layers.3.self_attn.q_proj', "
                f"up to {PATTERN_MAX_KEYS:,})"
            )
        self.compiled: list[tuple[int, str, Any]] = [(order, key, self._compile(key)) for order, key in expressions]

    def _compile(self, key: str) -> Any:
        try:
            return regex.compile(rf"(?:.*\.)?(?:{key})$")
        except (regex.error, OverflowError, RecursionError) as exc:
            raise UserError(f"{CONFIG_NAME}: {self.field} key {excerpt(key)} is not a valid regular expression ({exc})") from None

    def check_cost(self, modules: int, max_steps: int) -> None:
        """Refuse keys that would take more than ``max_steps`` steps against ``modules`` modules."""
        per_module = len(self.plain.forms) + len(self.compiled)
        if per_module * modules > max_steps:
            raise UserError(
                f"{CONFIG_NAME}: {self.field} has {len(self.values):,} keys, {len(self.compiled):,} of them regular "
                f"expressions and the rest plain names of {len(self.plain.forms):,} forms (length and dots); matching "
                f"them against the adapter's {modules:,} modules takes {per_module * modules:,} steps, at most "
                f"{max_steps:,} are accepted: name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
            )

    def value(self, module: str, default: Any) -> Any:
        """The value the first key matching ``module`` gives it, else ``default``."""
        best = self.plain.first(module)
        for order, key, pattern in self.compiled:
            if best is not None and order > best:
                break
            try:
                if pattern.match(module, timeout=MATCH_TIMEOUT_SECONDS):
                    best = order
                    break
            except TimeoutError:
                raise UserError(
                    f"{CONFIG_NAME}: {self.field} key {excerpt(key)} takes too long to match module names "
                    "(a pattern that backtracks); name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
                ) from None
        return self.values[best] if best is not None else default


def pattern_value(config: dict[str, Any], field: str, module: str, default: Any) -> Any:
    """The value ``config[field]`` gives ``module`` (the first key that matches), else ``default``."""
    return Patterns(config, field).value(module, default)
