"""Checking and unpacking an uploaded adapter archive (.tar.gz, .tar or .zip) before anything is stored.

An archive is read member by member, as a stream: every header is checked before its member's
bytes are written, and the running unpacked size is checked as it grows, so a few megabytes that
inflate to gigabytes are refused after reading at most the limit, never after inflating it all.
The weights' safetensors header is checked (floats that tile the file exactly; LoRA pairs of one
rank; with the base's weight shapes, each change the shape of the weight it targets) before the
weights themselves are written.
"""

from __future__ import annotations

import gzip
import shutil
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

from fp4prep.pipeline.errors import UserError
from fp4prep.pipeline.inputs.adapter_files import (
    CONFIG_NAME,
    PATTERN_MAX_SECONDS,
    PATTERN_MAX_STEPS,
    WEIGHTS_NAME,
    Shape,
    check_against_base,
    check_config,
    lora_pairs,
    match_budget,
    read_header,
)
from fp4prep.site.errors import InvalidInput, TooLarge
from fp4prep.text import clip, excerpt, parse_json, without_paths

ADAPTER_CONFIG = CONFIG_NAME
WEIGHTS = (WEIGHTS_NAME, "adapter_model.bin")
CHUNK = 1024 * 1024
# tar frames every member with a 512-byte header and pads it to 512 bytes; pax headers add a few more.
TAR_FRAMING_PER_MEMBER = 4 * 512
# Deflate and gzip both; the rest (bzip2, xz, lzma) is refused before it is decompressed.
ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
MAGIC = [
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"Rar!", "rar"),
]


def invalid(message: str) -> InvalidInput:
    return InvalidInput(message, code="invalid_archive")


@dataclass
class _Budget:
    """What may still be unpacked: bytes and members (files and directories alike), counted as
    they come; and the paths seen so far, so that no member lands inside a file or on a directory."""

    max_bytes: int
    max_files: int
    written: int = 0
    files: int = 0
    names: set[str] = field(default_factory=set)
    directories: set[str] = field(default_factory=set)

    def add_member(self, path: PurePosixPath, declared: int = 0, directory: bool = False) -> None:
        self.files += 1
        if self.files > self.max_files:
            raise invalid(
                f"archive holds more than {self.max_files:,} members (files and directories); at most {self.max_files:,} are accepted"
            )
        name = str(path)
        parents = [str(parent) for parent in path.parents if str(parent) != "."]
        for parent in parents:
            if parent in self.names:
                raise invalid(f"archive member {excerpt(name)} is inside {excerpt(parent)}, which is a file")
        if (name in self.names and directory) or (name in self.directories and not directory):
            raise invalid(f"archive holds {excerpt(name)} as a file and as a directory")
        if name in self.names:
            raise invalid(f"archive holds {excerpt(name)} twice")
        if directory:
            self.directories.update([name, *parents])
            return
        self.names.add(name)
        self.directories.update(parents)
        if self.written + declared > self.max_bytes:
            raise TooLarge(
                f"archive unpacks to more than {self.max_bytes:,} bytes ({excerpt(name)} alone declares {declared:,}); "
                "nothing was stored"
            )

    def count(self, n: int) -> None:
        self.written += n
        if self.written > self.max_bytes:
            raise TooLarge(f"archive unpacks to more than {self.max_bytes:,} bytes; nothing was stored")


class _Bounded:
    """A read-only stream that stops once more than ``limit`` bytes have come out of it: what tar
    reads between members (pax headers, padding) counts too."""

    def __init__(self, raw: Any, limit: int) -> None:
        self.raw, self.limit, self.consumed = raw, limit, 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return b"".join(iter(lambda: self.read(CHUNK), b""))
        data = self.raw.read(size)
        self.consumed += len(data)
        if self.consumed > self.limit:
            raise TooLarge(f"archive unpacks to more than {self.limit:,} bytes; nothing was stored")
        return data


EXTENDED_HEADER_MAX = 1024 * 1024
# A file system's limit on one name; a longer one would fail as the member is written.
NAME_PART_MAX_BYTES = 255
_EXTENDED_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class _MemberInfo(tarfile.TarInfo):
    """tarfile reads a pax or GNU long-name header whole into memory, whatever size it declares:
    refuse one over a megabyte before it is read (a name or a few attributes take bytes)."""

    def _proc_member(self, tarfile: Any) -> Any:
        if self.type in _EXTENDED_TYPES and self.size > EXTENDED_HEADER_MAX:
            raise invalid(f"archive has an extended header of {self.size:,} bytes; names and attributes take far less")
        return super()._proc_member(tarfile)  # type: ignore[misc]


def _check_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if (
        not name
        or path.is_absolute()
        or name.startswith(("/", "\\"))
        or ".." in path.parts
        or "\\" in name
        or ":" in name
        or any(ord(c) < 32 for c in name)
    ):
        raise invalid(f"archive member {excerpt(name)} has an unsafe path (absolute, '..', a drive or control characters)")
    if len(name) > 255 or any(len(part.encode()) > NAME_PART_MAX_BYTES for part in path.parts):
        raise invalid(
            f"archive member {excerpt(name)} has a name longer than 255 characters, or a part of it longer than "
            f"{NAME_PART_MAX_BYTES} bytes"
        )
    return path


class _Adapter:
    """What the member checks learn on the way: the config (once read) and the weights' shapes."""

    def __init__(self, base_shapes: dict[str, Any] | None, max_pattern_steps: int) -> None:
        self.base_shapes = base_shapes
        self.max_pattern_steps = max_pattern_steps
        self.config: dict[str, Any] | None = None
        self.shapes: dict[str, Shape] | None = None

    def copy(self, name: PurePosixPath, source: IO[bytes], size: int, target: Path, budget: _Budget) -> None:
        """Write one member, checking the weights' header before their data."""
        out = target / name
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("wb") as dst:
            if name.name == WEIGHTS_NAME:
                head, self.shapes = read_header(source, size)
                check_against_base(self.shapes, self.config, self.base_shapes, self.max_pattern_steps)
                budget.count(len(head))
                dst.write(head)
            elif name.name == ADAPTER_CONFIG and size > CHUNK:
                raise invalid(f"{ADAPTER_CONFIG} is {size:,} bytes; a PEFT config is a few KB")
            remaining = size - dst.tell()
            while remaining > 0:
                chunk = source.read(min(CHUNK, remaining))
                if not chunk:
                    raise invalid(f"archive member {excerpt(str(name))} is shorter than it declares")
                remaining -= len(chunk)
                budget.count(len(chunk))
                dst.write(chunk)
            if source.read(1):
                raise invalid(f"archive member {excerpt(str(name))} is larger than it declares")
        if name.name == ADAPTER_CONFIG:
            self.config = _read_config(out)
            check_config(self.config, [], self.max_pattern_steps)  # before the weights are checked against what it says


def extract(
    archive: Path, target: Path, *, max_bytes: int, max_files: int, base_shapes: dict[str, Any] | None = None,
    max_pattern_steps: int = PATTERN_MAX_STEPS,
) -> Path:
    """Unpack into ``target`` and return the adapter directory inside it, or raise naming the problem.

    Refused as soon as it is seen: a format other than .tar.gz, .tar or .zip; absolute or '..'
    paths, links, devices; more than ``max_files`` files or ``max_bytes`` unpacked; a weights file
    that is not a safetensors file of LoRA matrices fitting ``base_shapes``. Then the PEFT files
    must be there and the config must be one the merge can apply, its rank and alpha patterns
    costing at most ``max_pattern_steps`` to match.
    """
    # Every pattern match of this upload shares one time budget, each field compiled once.
    with match_budget(PATTERN_MAX_SECONDS):
        return _extract(archive, target, max_bytes, max_files, base_shapes, max_pattern_steps)


def _extract(
    archive: Path, target: Path, max_bytes: int, max_files: int, base_shapes: dict[str, Any] | None, max_pattern_steps: int
) -> Path:
    adapter = _Adapter(base_shapes, max_pattern_steps)
    budget = _Budget(max_bytes, max_files)
    target.mkdir(parents=True, exist_ok=True)
    try:
        with archive.open("rb") as f:
            magic = f.read(512)
        for prefix, fmt in MAGIC:
            if magic.startswith(prefix):
                raise invalid(f"archive is compressed with {fmt}; upload a .tar.gz, .tar or .zip")
        if magic.startswith(b"\x1f\x8b"):
            with gzip.open(archive, "rb") as stream:
                _untar(stream, target, budget, adapter)
        elif magic.startswith(b"PK"):
            _unzip(archive, target, budget, adapter)
        elif len(magic) >= 262 and magic[257:262] == b"ustar":
            with archive.open("rb") as stream:
                _untar(stream, target, budget, adapter)
        else:
            raise invalid("file is not a .tar.gz, .tar or .zip archive")
    except UserError as exc:
        raise invalid(str(exc)) from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise invalid(f"archive is truncated or corrupt: {without_paths(clip(str(exc), 120))}") from None
    except OSError as exc:  # writing a member: the reason, never the path it was written to
        raise invalid(f"archive could not be unpacked: {exc.strerror or 'the file system refused a member'}") from None
    directory = _adapter_dir(target)
    _check_adapter(directory, base_shapes, max_pattern_steps)
    return directory


def _untar(stream: Any, target: Path, budget: _Budget, adapter: _Adapter) -> None:
    bounded = _Bounded(stream, budget.max_bytes + TAR_FRAMING_PER_MEMBER * (budget.max_files + 2) + CHUNK)
    with tarfile.open(fileobj=bounded, mode="r|", tarinfo=_MemberInfo) as tar:  # type: ignore[call-overload]
        for info in tar:
            path = _check_name(info.name)
            if info.issym() or info.islnk():
                raise invalid(f"archive member {excerpt(info.name)} is a link; links are not accepted")
            if info.isdir():
                budget.add_member(path, directory=True)
                (target / path).mkdir(parents=True, exist_ok=True)
                continue
            if not info.isfile():
                raise invalid(f"archive member {excerpt(info.name)} is not a regular file or directory")
            budget.add_member(path, info.size)
            source = tar.extractfile(info)
            assert source is not None
            adapter.copy(path, source, info.size, target, budget)


def _unzip(archive: Path, target: Path, budget: _Budget, adapter: _Adapter) -> None:
    _check_zip_directory(archive, budget.max_files)
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            path = _check_name(info.filename.rstrip("/") if info.is_dir() else info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise invalid(f"archive member {excerpt(info.filename)} is a link; links are not accepted")
            if info.is_dir():
                budget.add_member(path, directory=True)
                (target / path).mkdir(parents=True, exist_ok=True)
                continue
            if info.compress_type not in ZIP_METHODS:
                raise invalid(
                    f"archive member {excerpt(info.filename)} is compressed with method {info.compress_type}; "
                    "only stored and deflated zip members are accepted"
                )
            budget.add_member(path, info.file_size)
            with zf.open(info) as source:  # a zip's declared sizes can lie: copy counts what comes out
                adapter.copy(path, source, info.file_size, target, budget)


# A central directory entry: 46 bytes, the name (at most 255 here), and room for the extra fields
# zip tools write (zip64 sizes, timestamps, Unicode names).
ZIP_ENTRY_MAX_BYTES = 46 + 255 + 1024


def _check_zip_directory(archive: Path, max_members: int) -> None:
    """Refuse a zip whose end record declares more than ``max_members`` entries, or a central
    directory too large for that many, before ``zipfile`` reads the directory into memory (it
    reads entries for as many bytes as the end record gives, whatever count it declares)."""
    size = archive.stat().st_size
    with archive.open("rb") as f:
        f.seek(max(0, size - (22 + 65535)))
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < 22:
            raise invalid("archive is not a zip file: it has no end of central directory record")
        entries, directory_bytes = struct.unpack("<HI", tail[at + 10 : at + 16])
        locator = tail[at - 20 : at] if at >= 20 else b""
        if locator[:4] == b"PK\x06\x07":  # zip64: the counts are in the record the locator points to
            (offset,) = struct.unpack("<Q", locator[8:16])
            f.seek(offset)
            record = f.read(56)
            if len(record) < 56 or record[:4] != b"PK\x06\x06":
                raise invalid("archive is truncated or corrupt: its zip64 end record is missing")
            entries, directory_bytes = struct.unpack("<QQ", record[32:48])
    if entries > max_members:
        raise invalid(
            f"archive holds {entries:,} members (files and directories); at most {max_members:,} are accepted"
        )
    if directory_bytes > max_members * ZIP_ENTRY_MAX_BYTES:
        raise invalid(
            f"archive's central directory takes {directory_bytes:,} bytes, more than {max_members:,} members need"
        )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = parse_json(path.read_bytes())
    except ValueError as exc:
        raise invalid(f"{ADAPTER_CONFIG} is not valid JSON: {clip(str(exc), 120)}") from None
    if not isinstance(config, dict):
        raise invalid(f"{ADAPTER_CONFIG} must hold a JSON object")
    return config


def _adapter_dir(root: Path) -> Path:
    """The directory holding adapter_config.json: the root, or its single top-level directory."""
    candidates = [root] + [p for p in root.iterdir() if p.is_dir()]
    found = [d for d in candidates if (d / ADAPTER_CONFIG).is_file()]
    if not found:
        raise invalid(f"archive has no {ADAPTER_CONFIG} at its top level (or in one top-level directory)")
    directory = found[0]
    if not any((directory / name).is_file() for name in WEIGHTS):
        raise invalid(f"archive has {ADAPTER_CONFIG} but no {' or '.join(WEIGHTS)} beside it")
    return directory


def _check_adapter(directory: Path, base_shapes: dict[str, Any] | None, max_pattern_steps: int) -> None:
    """The config against the weights, as the merge will read them (the headers again, from disk)."""
    config = _read_config(directory / ADAPTER_CONFIG)
    weights = directory / WEIGHTS_NAME
    try:
        if weights.is_file():
            with weights.open("rb") as f:
                _, shapes = read_header(f, weights.stat().st_size)
            check_config(config, lora_pairs(shapes)[0], max_pattern_steps)
            check_against_base(shapes, config, base_shapes, max_pattern_steps)
        else:
            check_config(config, [], max_pattern_steps)  # adapter_model.bin: its tensors are read when the job merges it
    except UserError as exc:
        raise invalid(str(exc)) from None


@contextmanager
def unpacking(root: Path) -> Iterator[Path]:
    """A fresh directory under ``root`` for one archive, removed however the block ends."""
    import tempfile

    root.mkdir(parents=True, exist_ok=True)
    unpacked = Path(tempfile.mkdtemp(prefix="adapter-", dir=root))
    try:
        yield unpacked
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def flatten(adapter_dir: Path, root: Path) -> None:
    """Make the adapter files sit at ``root`` itself (an archive may wrap them in one directory)."""
    if adapter_dir == root:
        return
    for child in list(root.iterdir()):
        if child != adapter_dir:
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
    # Renamed first, as a file inside may share the folder's name; to a name nothing inside has.
    inside = {item.name for item in adapter_dir.iterdir()}
    name = ".fp4prep-unwrap"
    while name in inside or name == adapter_dir.name:
        name += "_"
    unwrapped = adapter_dir.rename(root / name)
    for item in list(unwrapped.iterdir()):
        shutil.move(str(item), str(root / item.name))
    unwrapped.rmdir()
