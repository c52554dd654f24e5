"""Revision directories on the artifact store: manifests, registration and streaming downloads."""

from __future__ import annotations

import hashlib
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import StreamingHttpResponse

from fp4prep.hashing import file_sha256

from .models import Model, Revision

CHUNK = 1024 * 1024
# A directory's files (path, size, sha256), their total size and one sha256 over the list.
Listing = tuple[list[dict[str, Any]], int, str]


def manifest(directory: Path) -> Listing:
    """Every regular file with its size and sha256, and one sha256 over the whole list."""
    files: list[dict[str, Any]] = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        files.append(
            {"path": path.relative_to(directory).as_posix(), "size": path.stat().st_size, "sha256": file_sha256(path)}
        )
    overall = hashlib.sha256("".join(f"{f['sha256']}  {f['path']}\n" for f in files).encode()).hexdigest()
    return files, sum(f["size"] for f in files), overall


def store_revision(
    model: Model, source: Path, *, metadata: dict[str, Any] | None = None, job_id: str = "", listing: Listing | None = None
) -> Revision:
    """Move ``source`` into the store and register it as the model's next revision.

    ``listing`` is ``manifest(source)`` when the caller hashed it already (outside its locks). The
    move happens first and is undone if the row can't be written, so the registry never holds a
    revision without its files, nor leaves files of a revision that isn't registered.
    """
    files, size, digest = listing or manifest(source)
    revision = Revision(model=model, size_bytes=size, sha256=digest, files=files, metadata=metadata or {}, job_id=job_id)
    revision.path = f"models/{model.id}/{revision.id}"
    target = settings.ARTIFACT_ROOT / revision.path
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(source), str(target))
    try:
        with transaction.atomic():
            # Lock the model row: two jobs finishing at once must not take the same number.
            Model.objects.select_for_update().filter(pk=model.pk).first()
            last = model.revisions.order_by("-number").values_list("number", flat=True).first()
            revision.number = (last or 0) + 1
            revision.save()
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return revision


def tar_size(revision: Revision) -> int:
    total = 1024  # two zero blocks end the archive
    for f in revision.files:
        total += len(_header(f["path"], f["size"])) + f["size"] + _padding(f["size"])
    return total


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT)


def _padding(size: int) -> int:
    return (-size) % tarfile.BLOCKSIZE


def tar_stream(revision: Revision) -> Iterator[bytes]:
    """The revision's files as an uncompressed tar, read and sent a chunk at a time."""
    root = revision.directory
    for f in revision.files:
        yield _header(f["path"], f["size"])
        with (root / f["path"]).open("rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk
        yield b"\0" * _padding(f["size"])
    yield b"\0" * 1024


def download_response(revision: Revision) -> StreamingHttpResponse:
    """The revision as a streamed .tar, sized up front so clients show progress and verify length."""
    response = StreamingHttpResponse(tar_stream(revision), content_type="application/x-tar")
    response["Content-Length"] = str(tar_size(revision))
    response["Content-Disposition"] = f'attachment; filename="{revision.model_id}-{revision.id}.tar"'
    response["X-Content-SHA256"] = revision.sha256
    return response
