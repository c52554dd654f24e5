"""What the API returns, as typed objects (the fields the API documents).

Every object keeps the JSON it came from in ``raw`` (what ``--json`` prints); fields the server adds
later are ignored rather than refused.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

from fp4prep.statuses import TERMINAL

T = TypeVar("T")


def parse(cls: type[T], data: Any) -> T:
    """Build dataclass ``cls`` from JSON, converting nested objects, lists and timestamps by type hint."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == "raw":
            continue
        if f.name in data:
            values[f.name] = _convert(hints[f.name], data[f.name])
    obj = cls(**values)
    if "raw" in {f.name for f in dataclasses.fields(cls)}:  # type: ignore[arg-type]
        obj.raw = data  # type: ignore[attr-defined]
    return obj


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    if hint is datetime:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dataclasses.is_dataclass(hint):
        return parse(hint, value)  # type: ignore[arg-type]
    return value


@dataclass
class Project:
    id: str
    name: str = ""
    key_scope: str = "full"  # the asking key's: "full", or "read" (list and fetch only)
    blocked: bool = False
    balance_usd: float = 0.0
    held_usd: float = 0.0
    available_usd: float = 0.0
    # The server's upload limits: calibration_file_bytes, adapter_archive_bytes.
    limits: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class ApiKey:
    """One of the project's API keys; ``key`` (the key itself) only in the answer that created it."""

    id: int
    name: str = ""
    scope: str = "full"
    prefix: str = ""
    created_at: datetime | None = None
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None
    key: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class LineError:
    line: int
    message: str


@dataclass
class FileReport:
    conversations: int = 0
    error_count: int = 0
    errors: list[LineError] = field(default_factory=list)
    summary: str = ""


@dataclass
class File:
    id: str
    purpose: str = ""
    filename: str = ""
    size_bytes: int = 0
    sha256: str = ""
    status: str = ""  # processed | error
    report: FileReport = field(default_factory=FileReport)
    created_at: datetime | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class RevisionFile:
    path: str
    size: int
    sha256: str


@dataclass
class Revision:
    id: str
    model_id: str = ""
    number: int = 0
    size_bytes: int = 0
    sha256: str = ""
    files: list[RevisionFile] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    job_id: str = ""
    created_at: datetime | None = None
    download_url: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Model:
    id: str
    kind: str = ""
    name: str = ""
    base_model: str = ""
    project_id: str | None = None
    supported_base: str | None = None
    source_adapter_id: str | None = None
    created_at: datetime | None = None
    latest_revision: Revision | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class DeploymentProfile:
    id: str
    name: str = ""
    hardware: str = ""
    gpu_count: int = 0
    quantization: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Estimate:
    price_usd: float
    time_hours: float
    allowed_to_proceed: bool
    reason: str = ""
    balance_usd: float = 0.0
    held_usd: float = 0.0
    available_usd: float = 0.0
    base_model: str = ""
    quantization: str = ""
    adapter_object_id: str = ""
    adapter_revision_id: str = ""
    calibration_file_id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class JobInputs:
    adapter_object_id: str
    adapter_revision_id: str | None = None
    calibration_file_id: str | None = None


@dataclass
class JobResults:
    api_model_object_id: str
    api_model_revision_id: str


@dataclass
class Job:
    id: str
    status: str
    stage: str = ""
    progress: float = 0.0
    eta_seconds: float | None = None
    inputs: JobInputs | None = None
    base_model: str = ""
    quantization: str = ""
    estimate: dict[str, Any] = field(default_factory=dict)
    results: JobResults | None = None
    worker: str = ""
    created_at: datetime | None = None
    queued_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    report: dict[str, Any] | None = None  # retrieve() only: parity, retention, task, sizes
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass
class Event:
    id: int
    created_at: datetime
    type: str
    message: str
    level: str = "info"
    data: dict[str, Any] | None = None


@dataclass
class EventList:
    data: list[Event] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Page(Generic[T]):
    """One page of a list; ``next`` is the URL of the following page, None on the last."""

    data: list[T]
    total: int
    page: int
    page_size: int
    next: str | None
    previous: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, item: type[T], body: dict[str, Any]) -> Page[T]:
        return cls(
            data=[parse(item, row) for row in body.get("data", [])],
            total=body.get("total", 0),
            page=body.get("page", 1),
            page_size=body.get("page_size", 0),
            next=body.get("next"),
            previous=body.get("previous"),
            raw=body,
        )
