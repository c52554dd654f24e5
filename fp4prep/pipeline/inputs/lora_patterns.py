"""An adapter config's ``rank_pattern`` / ``alpha_pattern``: which rank and alpha each module gets.

Their keys are regular expressions that PEFT matches against the end of a module's dotted name,
the first key that matches giving the value. Most are plain module names
(``layers.3.self_attn.q_proj``), looked up here by form rather than matched one by one. The rest
are matched with the ``regex`` engine: Python's ``re`` backtracks exponentially on patterns such
as ``(.*.*)*Z``, holding the GIL for hours, while ``regex`` handles those in linear time, under a
per-match timeout for whatever is left. What matching would cost is counted before it starts.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
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
# What one upload's pattern matching may take in all (``match_budget``).
PATTERN_MAX_SECONDS = 1.0
# A regular expression's size once its counted repeats are expanded (``(?:x{1024}){1024}`` is a
# million): the engine builds that much when it compiles, so it is bounded before compiling.
PATTERN_MAX_EXPANDED = 4096
# A module name counts one matching step per this many characters: what a match costs grows with
# the name it runs over.
STEP_CHARS = 64
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.]+")
_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_GROUP = re.compile(r"\(\?(?:P?<[A-Za-z_]\w*>|[A-Za-z-]*:|<?[=!]|>|\|)")  # what opens a group with contents


def expanded_size(key: str) -> int:
    """An upper bound on ``key``'s size with every counted repeat (``{n}``, ``{n,m}``) written out:
    each atom (a character, an escape, a class) counts one, a group the sum of its contents, a
    repeat multiplies what it repeats by its larger count."""
    stack = [[0, 0]]  # per open group: its size so far, the size of its last atom
    i = 0
    while i < len(key):
        c = key[i]
        if c == "\\":
            i += 2
            if i < len(key) and key[i - 1] in "pPNxuUg" and key[i] == "{":
                i = key.find("}", i) + 1 or len(key)
            atom = 1
        elif c == "[":
            j = i + 1
            if j < len(key) and key[j] == "^":
                j += 1
            j += 1  # a "]" first in a class is itself
            while j < len(key) and key[j] != "]":
                j += 2 if key[j] == "\\" else 1
            i, atom = j + 1, 1
        elif c == "(":
            special = key.startswith("(?", i)
            opens = _GROUP.match(key, i) if special else None
            if special and opens is None:
                i = key.find(")", i) + 1 or len(key)  # (?i), (?#...), (?P=name): no contents of its own
                atom = 1
            else:
                stack.append([0, 0])
                i = opens.end() if opens else i + 1
                continue
        elif c == ")" and len(stack) > 1:
            atom = max(stack.pop()[0], 1)
            i += 1
        elif c == "{" and (found := _REPEAT.match(key, i)) and (found[1] or found[2]):
            counts = [d for d in (found[1], found[2]) if d]
            count = max(int(d) if len(d) <= 7 else 10**7 for d in counts)
            total, last = stack[-1]
            stack[-1] = [total + last * (count - 1), last * count]
            i = found.end()
            continue
        elif c == "|":
            stack[-1][1] = 0
            i += 1
            continue
        else:
            atom, i = 1, i + 1
        stack[-1][0] += atom
        stack[-1][1] = atom
    return sum(total for total, _ in stack)


@dataclass
class _Budget:
    """One upload's time for matching patterns, and the fields' compiled patterns it reuses."""

    seconds: float
    deadline: float
    compiled: dict[tuple[str, str], Patterns] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> UserError:
        return UserError(
            f"{CONFIG_NAME}: matching its rank_pattern and alpha_pattern keys against the adapter's modules "
            f"takes more than {self.seconds:g} s; name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
        )


_budget: ContextVar[_Budget | None] = ContextVar("pattern_budget", default=None)


@contextlib.contextmanager
def match_budget(seconds: float) -> Iterator[None]:
    """Within this, all pattern matching shares ``seconds`` of time (a refusal once spent, never
    work that goes on after the answer), and each field's keys are compiled and matched against a
    module once however many checks ask (``Patterns.of``)."""
    token = _budget.set(_Budget(seconds, time.monotonic() + seconds))
    try:
        yield
    finally:
        _budget.reset(token)


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
    up by form; other keys are matched one by one, each module once. What matching costs is the
    number of forms times the number of modules, plus the regular expressions times the length of
    the module names: ``check_cost`` refuses more than a bound before anything is matched.
    """

    @classmethod
    def of(cls, config: dict[str, Any], field: str) -> Patterns:
        """The field's patterns, compiled once within a ``match_budget``."""
        budget = _budget.get()
        if budget is None:
            return cls(config, field)
        key = (field, json.dumps(config.get(field) or {}, sort_keys=False))
        if key not in budget.compiled:
            budget.compiled[key] = cls(config, field)
        return budget.compiled[key]

    def __init__(self, config: dict[str, Any], field: str) -> None:
        self.field = field
        self._matched: dict[str, int | None] = {}
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
        if (size := expanded_size(key)) > PATTERN_MAX_EXPANDED:
            raise UserError(
                f"{CONFIG_NAME}: {self.field} key {excerpt(key)} repeats too much: written out it is "
                f"{size:,} characters, at most {PATTERN_MAX_EXPANDED:,} are accepted"
            )
        try:
            # Not kept in the engine's own cache: compiled patterns of every upload would stay there.
            return regex.compile(rf"(?:.*\.)?(?:{key})$", cache_pattern=False)
        except (regex.error, OverflowError, RecursionError) as exc:
            raise UserError(f"{CONFIG_NAME}: {self.field} key {excerpt(key)} is not a valid regular expression ({exc})") from None

    def check_cost(self, modules: list[str], max_steps: int) -> None:
        """Refuse keys that would take more than ``max_steps`` steps against ``modules``: a lookup
        per form of plain keys and module, a match per regular expression and ``STEP_CHARS``
        characters of each module's name."""
        lengths = sum(-(-len(m) // STEP_CHARS) for m in modules)
        steps = len(self.plain.forms) * len(modules) + len(self.compiled) * lengths
        if steps > max_steps:
            raise UserError(
                f"{CONFIG_NAME}: {self.field} has {len(self.values):,} keys, {len(self.compiled):,} of them regular "
                f"expressions and the rest plain names of {len(self.plain.forms):,} forms (length and dots); matching "
                f"them against the adapter's {len(modules):,} modules takes {steps:,} steps, at most "
                f"{max_steps:,} are accepted: name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
            )

    def value(self, module: str, default: Any) -> Any:
        """The value the first key matching ``module`` gives it, else ``default``."""
        if module not in self._matched:
            self._matched[module] = self._first(module)
        best = self._matched[module]
        return self.values[best] if best is not None else default

    def _first(self, module: str) -> int | None:
        best = self.plain.first(module)
        budget = _budget.get()
        for order, key, pattern in self.compiled:
            if best is not None and order > best:
                break
            timeout = MATCH_TIMEOUT_SECONDS
            if budget is not None:
                timeout = min(timeout, budget.left())
                if timeout <= 0:
                    raise budget.spent()
            try:
                if pattern.match(module, timeout=timeout):
                    best = order
                    break
            except TimeoutError:
                if budget is not None and budget.left() <= 0:
                    raise budget.spent() from None
                raise UserError(
                    f"{CONFIG_NAME}: {self.field} key {excerpt(key)} takes too long to match module names "
                    "(a pattern that backtracks); name the modules plainly, e.g. 'layers.3.self_attn.q_proj'"
                ) from None
        return best


def pattern_value(config: dict[str, Any], field: str, module: str, default: Any) -> Any:
    """The value ``config[field]`` gives ``module`` (the first key that matches), else ``default``."""
    return Patterns.of(config, field).value(module, default)
