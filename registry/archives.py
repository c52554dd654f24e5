"""Checking and unpacking an uploaded adapter archive (.tar.gz or .zip) before anything is stored."""

from __future__ import annotations

import json
import lzma
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from fp4prep.errors import InvalidInput, TooLarge

ADAPTER_CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _check_name(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith(("/", "\\")) or ".." in path.parts or "\\" in name or ":" in name:
        raise InvalidInput(f"archive member {name!r} has an unsafe path (absolute, '..', or a drive)", code="invalid_archive")
    return path


def extract(archive: Path, target: Path, *, max_bytes: int, max_files: int) -> Path:
    """Unpack into ``target`` and return the adapter directory inside it, or raise naming the problem.

    Refused before anything is written: absolute or '..' paths, links, devices, more than
    ``max_files`` members, more than ``max_bytes`` uncompressed. Then the PEFT files must be there.
    """
    try:
        _unpack(archive, target, max_bytes, max_files)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        raise InvalidInput(f"archive is truncated or corrupt: {exc}", code="invalid_archive") from None
    return _adapter_dir(target)


def _unpack(archive: Path, target: Path, max_bytes: int, max_files: int) -> None:
    members: list[tuple[PurePosixPath, int]] = []
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tar:
            tar_infos = tar.getmembers()
            for info in tar_infos:
                path = _check_name(info.name)
                if info.issym() or info.islnk():
                    raise InvalidInput(f"archive member {info.name!r} is a link; links are not accepted", code="invalid_archive")
                if not (info.isfile() or info.isdir()):
                    raise InvalidInput(f"archive member {info.name!r} is not a regular file or directory", code="invalid_archive")
                if info.isfile():
                    members.append((path, info.size))
            _check_totals(members, max_bytes, max_files)
            target.mkdir(parents=True, exist_ok=True)
            tar.extractall(target, members=[i for i in tar_infos if i.isfile() or i.isdir()], filter="data")
    elif zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            zip_infos = zf.infolist()
            for zinfo in zip_infos:
                path = _check_name(zinfo.filename)
                mode = zinfo.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise InvalidInput(f"archive member {zinfo.filename!r} is a link; links are not accepted", code="invalid_archive")
                if not zinfo.is_dir():
                    members.append((path, zinfo.file_size))
            _check_totals(members, max_bytes, max_files)
            target.mkdir(parents=True, exist_ok=True)
            for zinfo in zip_infos:
                if zinfo.is_dir():
                    continue
                out = target / zinfo.filename
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(zinfo) as src, out.open("wb") as dst:
                    # Count what is really written: a zip's declared sizes can lie.
                    written = 0
                    while chunk := src.read(1024 * 1024):
                        written += len(chunk)
                        if written > zinfo.file_size:
                            raise InvalidInput(f"archive member {zinfo.filename!r} is larger than it declares", code="invalid_archive")
                        dst.write(chunk)
    else:
        raise InvalidInput("file is not a .tar.gz, .tar or .zip archive", code="invalid_archive")


def _check_totals(members: list[tuple[PurePosixPath, int]], max_bytes: int, max_files: int) -> None:
    if len(members) > max_files:
        raise InvalidInput(f"archive holds {len(members)} files; at most {max_files} are accepted", code="invalid_archive")
    total = sum(size for _, size in members)
    if total > max_bytes:
        raise TooLarge(f"archive unpacks to {total:,} bytes; at most {max_bytes:,} are accepted")


def _adapter_dir(root: Path) -> Path:
    """The directory holding adapter_config.json: the root, or its single top-level directory."""
    candidates = [root] + [p for p in root.iterdir() if p.is_dir()]
    found = [d for d in candidates if (d / ADAPTER_CONFIG).is_file()]
    if not found:
        raise InvalidInput(f"archive has no {ADAPTER_CONFIG} at its top level (or in one top-level directory)", code="invalid_archive")
    directory = found[0]
    if not any((directory / name).is_file() for name in WEIGHTS):
        raise InvalidInput(f"archive has {ADAPTER_CONFIG} but no {' or '.join(WEIGHTS)} beside it", code="invalid_archive")
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(f"{ADAPTER_CONFIG} is not valid JSON: {exc}", code="invalid_archive") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise InvalidInput(f"{ADAPTER_CONFIG} does not describe a LoRA adapter (peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})", code="invalid_archive")
    return directory


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
    unwrapped = adapter_dir.rename(root / ".fp4prep-unwrap")  # a file inside may share the folder's name
    for item in list(unwrapped.iterdir()):
        shutil.move(str(item), str(root / item.name))
    unwrapped.rmdir()
