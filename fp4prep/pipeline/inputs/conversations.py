"""Calibration files: JSONL conversations in the chat format of SFT data.

``validate`` streams a file and reports every bad line (up to a cap) with its number and what is
wrong, so the service can store the report and the pipeline can refuse what the report refuses.
It keeps counts, never the rows: a 64 MiB file is checked in the memory of its longest line.
Values quoted back in a message are cut short (``excerpt``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4prep.text import excerpt, parse_json

from ..errors import UserError

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED_ERRORS = 100


@dataclass
class Conversation:
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class LineError:
    line: int
    message: str


@dataclass
class ValidationReport:
    conversations: int = 0
    error_count: int = 0
    errors: list[LineError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.conversations > 0

    def add(self, line: int, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(LineError(line, message))

    def summary(self) -> str:
        if self.conversations == 0 and self.error_count == 0:
            return "the file holds no conversations"
        shown = "; ".join(f"line {e.line}: {e.message}" for e in self.errors[:5])
        more = self.error_count - min(5, len(self.errors))
        return shown + (f"; and {more} more" if more > 0 else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "error_count": self.error_count,
            "errors": [{"line": e.line, "message": e.message} for e in self.errors],
        }


def _check_tool_calls(calls: Any, where: str) -> str | None:
    if not isinstance(calls, list) or not calls:
        return f"{where}.tool_calls must be a non-empty list"
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"{where}.tool_calls[{j}].function.name must be a non-empty string"
        if "arguments" in fn and not isinstance(fn["arguments"], (str, dict)):
            return f"{where}.tool_calls[{j}].function.arguments must be a string or an object"
    return None


def _check_message(message: Any, i: int) -> str | None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        return f"{where} must be an object"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role must be one of {', '.join(ROLES)}, not {excerpt(role)}"
    content = message.get("content")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            return f"{where}: only assistant messages may have tool_calls"
        problem = _check_tool_calls(calls, where)
        if problem:
            return problem
    if content is None and calls is None:
        return f"{where}.content is missing"
    if (
        content is not None
        and not isinstance(content, str)
        and not (
            isinstance(content, list)
            and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            )
        )
    ):
        return f"{where}.content must be a string or a list of text parts"
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        return f"{where}: a tool message needs a tool_call_id"
    return None


def _check_tools(tools: Any) -> str | None:
    if not isinstance(tools, list):
        return "tools must be a list of function schemas"
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            return f"tools[{j}] must be an object of type 'function'"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"tools[{j}].function.name must be a non-empty string"
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            return f"tools[{j}].function.parameters must be a JSON schema object"
    return None


def parse_line(text: str) -> tuple[Conversation | None, str | None]:
    try:
        row = parse_json(text)
    except ValueError as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(row, dict):
        return None, "each line must be a JSON object with a messages list"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return None, "messages must be a non-empty list"
    for i, message in enumerate(messages):
        problem = _check_message(message, i)
        if problem:
            return None, problem
    if not any(m["role"] in ("user", "assistant") for m in messages):
        return None, "a conversation needs at least one user or assistant message"
    tools = row.get("tools")
    if tools is not None:
        problem = _check_tools(tools)
        if problem:
            return None, problem
    unknown = set(row) - {"messages", "tools"}
    if unknown:
        return None, f"unknown field {excerpt(sorted(unknown)[0])}: a line holds messages and tools"
    return Conversation(0, messages, tools), None


def iter_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, str]]:
    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, "\x00not utf-8"
                continue
        yield number, raw


def _checked(lines: Iterable[bytes | str], report: ValidationReport) -> Iterator[Conversation]:
    for number, text in iter_lines(lines):
        if text == "\x00not utf-8":
            report.add(number, "not UTF-8 text")
            continue
        if not text.strip():
            continue
        conversation, problem = parse_line(text)
        if problem:
            report.add(number, problem)
        else:
            assert conversation is not None
            conversation.line = number
            report.conversations += 1
            yield conversation


def validate(lines: Iterable[bytes | str]) -> ValidationReport:
    """Check every line; the report counts conversations and lists bad lines (up to a cap)."""
    report = ValidationReport()
    for _ in _checked(lines, report):
        pass
    return report


def parse(lines: Iterable[bytes | str]) -> Iterator[Conversation]:
    """The valid conversations, one at a time, with their line numbers (bad lines are skipped)."""
    yield from _checked(lines, ValidationReport())


def read(path: Path) -> list[Conversation]:
    """The file's conversations, or a UserError naming its bad lines."""
    if not path.is_file():
        raise UserError(f"calibration file {path} does not exist")
    with path.open("rb") as f:
        report = validate(f)
    if not report.ok:
        raise UserError(f"calibration file {path.name} did not pass validation: {report.summary()}")
    with path.open("rb") as f:
        return list(parse(f))
