"""Writing a model prepared from an FP4 release in the release's own format.

Shard by shard, with the release's file names, tensor names, dtypes and config: every tensor the
adapter does not change is copied byte for byte from the release; a quantized weight it changes gets
new E2M1 codes on the release's own block (and global) scales, which are copied too; a tensor the
release keeps unquantized that the adapter changes is written merged, in the release's dtype. So
the engine serves the prepared model exactly as it serves the release, the adapter's change aside.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..formats.numerics import scale_blocks
from ..model.merge import MergedWeights
from ..model.releases import BaseSource, QuantizedTensor
from ..model.safetensors import Entry, SafetensorsFile, rewrite_safetensors, safetensors_files

# A rounding: the changed weight (float32, by the stored rows) and its blocks' steps -> E2M1 values.
Rounding = Callable[[QuantizedTensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ReleaseWrite:
    """What writing the prepared model changed in the release: the reload check's reference (each
    changed weight's SHA-256 as written, dequantized to float32) and the counts the report gives."""

    copied: int = 0  # stored tensors copied byte for byte
    requantized: list[str] = field(default_factory=list)  # quantized weights given new codes
    rewritten: list[str] = field(default_factory=list)  # unquantized tensors written merged
    digests: dict[str, str] = field(default_factory=dict)
    rounding: dict[str, Any] = field(default_factory=dict)  # how the changed weights were rounded, what they kept

    def summary(self) -> dict[str, Any]:
        return {
            "copied": self.copied, "requantized": len(self.requantized), "rewritten": len(self.rewritten), **self.rounding,
        }


def digest(weight: torch.Tensor) -> str:
    return hashlib.sha256(weight.float().contiguous().cpu().numpy().tobytes()).hexdigest()


def write(source: BaseSource, merged: MergedWeights, out: Path, rounding: Rounding, report: Callable[[float], None]) -> ReleaseWrite:
    """The prepared model in ``source``'s own format, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.directory.iterdir()):
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    changed = set(merged.targets())
    by_part = {part: tensor for tensor in source.quantized.values() for part in tensor.parts.values()}
    written = ReleaseWrite()
    shards = safetensors_files(source.directory)
    for i, path in enumerate(shards):
        shard = SafetensorsFile(path)
        entries: dict[str, Entry] = {}
        for name in shard.entries:
            tensor = by_part.get(name)
            if tensor is not None and tensor.name in changed and name == tensor.parts["packed"]:
                entries[name] = _requantized(source, merged, tensor, rounding, written)
            elif tensor is None and name in changed:
                rewritten = merged.merged(name).to(shard.dtype(name)).cpu()
                entries[name] = rewritten
                written.rewritten.append(name)
                written.digests[name] = digest(rewritten)
            else:
                entries[name] = name
                written.copied += 1
        rewrite_safetensors(shard, out / path.name, entries)
        report((i + 1) / len(shards))
    return written


def _requantized(source: BaseSource, merged: MergedWeights, tensor: QuantizedTensor, rounding: Rounding, written: ReleaseWrite) -> torch.Tensor:
    def read(name: str) -> torch.Tensor:
        return source.raw(name).to(merged.device)

    steps = tensor.steps(read)
    values = rounding(tensor, tensor.rows(merged.merged(tensor.name).float()), steps)
    written.requantized.append(tensor.name)
    written.digests[tensor.name] = digest(tensor.dense(scale_blocks(values, steps)))
    return tensor.pack(values).cpu()
