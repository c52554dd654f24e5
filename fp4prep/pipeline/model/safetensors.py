"""Reading Hugging Face checkpoint directories (config + safetensors), one tensor at a time.

A base may be stored as block-scaled FP8 (E4M3 weights with a ``weight_scale_inv`` per 128x128
block, as FP8 releases of large MoE models ship); ``TensorSource`` dequantizes those to BF16 on read.

Tensors are read with ``preadv`` into fresh buffers rather than through safetensors' memory map:
pages of a mapped file count towards the process's resident set for as long as the file stays
open, so streaming a 1.5 TB base through a map would show (and, under memory pressure, cost) far
more than the one layer we hold.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from . import reads

FP8_BLOCK = 128
SCALE_INV_SUFFIX = "_scale_inv"
READ_CHUNK = 1 << 30  # preadv moves at most ~2 GiB per call on Linux

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a Hugging Face checkpoint: config.json is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} holds no .safetensors weights")
    return files


class SafetensorsFile:
    """One .safetensors file: its header parsed once, each tensor read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not a readable safetensors file ({exc})") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self.data_start = 8 + length

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        start, end = entry["data_offsets"]
        raw = torch.empty(end - start, dtype=torch.uint8)
        view = memoryview(raw.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done : done + READ_CHUNK]], self.data_start + start + done)
                if n <= 0:
                    raise UserError(f"{self.path} is truncated: {name} ends past the end of the file")
                done += n
        finally:
            os.close(fd)
        reads.count(self.path, done)
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# What a rewritten entry holds: the bytes of a tensor of the source file (by its name there), or a
# new tensor.
Entry = str | torch.Tensor


def rewrite_safetensors(source: SafetensorsFile, target: Path, entries: dict[str, Entry]) -> None:
    """Write ``entries`` (new name -> source tensor name, or a tensor) as a safetensors file.

    Bytes copied from the source stream through a small buffer, so rewriting a shard costs memory
    for the new tensors only. ``target`` may be the source's own path: the file is replaced whole.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in entries.items():
        if isinstance(entry, str):
            e = source.entries[entry]
            dtype, shape, size = e["dtype"], e["shape"], e["data_offsets"][1] - e["data_offsets"][0]
        else:
            dtype, shape, size = _NAMES[entry.dtype], list(entry.shape), entry.numel() * entry.element_size()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out, source.path.open("rb") as f:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for entry in entries.values():
            if isinstance(entry, str):
                start, end = source.entries[entry]["data_offsets"]
                f.seek(source.data_start + start)
                left = end - start
                while left:
                    chunk = f.read(min(left, 64 << 20))
                    out.write(chunk)
                    left -= len(chunk)
                reads.count(source.path, end - start)
            else:
                out.write(entry.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(partial, target)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """E4M3 weight times its per-128x128-block inverse scale, in fp32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.float() * scale[:rows, :cols]


class TensorSource:
    """Lazy access to a checkpoint's tensors by name, FP8 blocks dequantized to BF16."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._where: dict[str, SafetensorsFile] = {}
        for path in safetensors_files(directory):
            if not path.is_file():
                raise UserError(f"{directory}: the index names {path.name}, which is missing")
            file = SafetensorsFile(path)
            for key in file.entries:
                self._where[key] = file

    def names(self) -> list[str]:
        return [k for k in self._where if not k.endswith(SCALE_INV_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._where[name].dtype(name)

    def get(self, name: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor in ``dtype`` on ``device`` (FP8 blocks are dequantized there)."""
        tensor = self.raw(name).to(device)
        scale_name = name + SCALE_INV_SUFFIX
        if tensor.dtype == torch.float8_e4m3fn:
            if scale_name not in self._where:
                raise UserError(f"{name} is stored as FP8 without its {scale_name} block scales")
            tensor = dequantize_fp8_blocks(tensor, self.raw(scale_name).to(device))
        return tensor.to(dtype)

    def items(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.get(name, dtype)


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
