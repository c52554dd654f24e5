"""Storing and validating an uploaded calibration file (JSONL conversations, validated line by line)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from typing import IO, Any

from django.db import transaction

from fp4prep.pipeline.inputs.conversations import validate
from fp4prep.site.errors import InvalidInput, check_length
from fp4prep.text import excerpt, format_bytes
from registry.models import Project
from registry.services import claim_storage, quota_exceeded, storage_left

from .models import CalibrationFile

PURPOSES = ("calibration",)


# How much of the upload is read at a time.
CHUNK = 1 << 20


def _lines(stream: IO[bytes], digest: Any, copy: IO[bytes]) -> Iterator[bytes]:
    """The file's lines, hashed and copied to the store on the way through (one pass). Read in
    chunks and split here, linear in the line's length: iterating an uploaded file by lines joins
    its chunks one at a time, quadratic on a long line (64 MiB: tens of seconds)."""
    partial: list[bytes] = []
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
        copy.write(chunk)
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            partial.append(chunk[start : end + 1])
            yield b"".join(partial)
            partial.clear()
            start = end + 1
        if start < len(chunk):
            partial.append(chunk[start:])
    if partial:
        yield b"".join(partial)


def store(project: Project, stream: IO[bytes], filename: str, purpose: str = "calibration") -> CalibrationFile:
    """Validate every line and keep the file with its report; a file that fails is kept as ``error``
    so its report can be read, and no job accepts it."""
    if purpose not in PURPOSES:
        raise InvalidInput(f"purpose: must be one of {', '.join(PURPOSES)}, not {excerpt(purpose)}")
    size = stream.seek(0, os.SEEK_END)
    if size > storage_left(project):
        raise quota_exceeded(project, f"this {format_bytes(size)} file")
    record = CalibrationFile(project=project, purpose=purpose, filename=check_length("filename", filename, 255) or "calibration.jsonl")
    record.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.path.with_suffix(".part")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as copy:
            stream.seek(0)
            report = validate(_lines(stream, digest, copy))
        record.size_bytes = tmp.stat().st_size
        record.sha256 = digest.hexdigest()
        record.status = CalibrationFile.Status.PROCESSED if report.ok else CalibrationFile.Status.ERROR
        record.report = {**report.to_dict(), "summary": "ok" if report.ok else report.summary()}
        with transaction.atomic():
            claim_storage(project, record.size_bytes, f"this {format_bytes(record.size_bytes)} file")
            shutil.move(str(tmp), str(record.path))
            record.save()
    except BaseException:
        tmp.unlink(missing_ok=True)
        record.path.unlink(missing_ok=True)
        raise
    return record
