"""Bases that ship quantized: what a release stores for each quantized weight, and the weight the
serving engine multiplies by, which is what an adapter trained on the release was trained on.

Read here, one tensor at a time like any base:

- compressed-tensors' ``nvfp4-pack-quantized`` (``weight_packed`` E2M1 pairs, ``weight_scale`` E4M3
  per 16 values, ``weight_global_scale`` a divisor) and ``mxfp4-pack-quantized`` (``weight_scale``
  an E8M0 exponent per 32 values);
- ModelOpt's NVFP4 export (``weight`` E2M1 pairs, ``weight_scale`` E4M3, ``weight_scale_2`` a
  multiplier);
- the ``quant_method: mxfp4`` layout of OpenAI's gpt-oss releases: each fused expert tensor as
  ``<name>_blocks`` (``[experts, rows, blocks, 16]`` bytes of E2M1 pairs) and ``<name>_scales``
  (``[experts, rows, blocks]`` E8M0), stored output-major and read as transformers holds the dense
  tensor, ``[experts, inputs, outputs]``.

Whatever the release kept unquantized (its ignore list: attention, shared experts, routers,
embeddings) is stored as it is and read as it is. Block-scaled FP8 bases are read by
``safetensors.TensorSource``. A base that declares any other quantization is refused before any work,
naming what it declares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..formats import FORMATS, Format
from ..formats.numerics import pack_e2m1, scale_blocks, unpack_e2m1
from .safetensors import TensorSource, read_config

Shape = tuple[int, ...]
GPT_OSS_BLOCK_BYTES = 16  # 32 E2M1 values a block


@dataclass(frozen=True)
class Release:
    """How a quantized base declares itself (its config.json's ``quantization_config``)."""

    method: str  # "compressed-tensors", "modelopt" or "mxfp4" (gpt-oss)
    format: Format  # NVFP4 or MXFP4
    quantization_config: dict[str, Any]  # as declared: what a model prepared from it declares too

    def tensors(self, shapes: Mapping[str, Shape]) -> dict[str, QuantizedTensor]:
        """The quantized weights among the stored tensors ``shapes``, by the dense name each stands for."""
        if self.method == "mxfp4":
            return _gpt_oss_tensors(self, shapes)
        packed = "weight_packed" if self.method == "compressed-tensors" else "weight"
        found = {}
        for name in shapes:
            module, _, leaf = name.rpartition(".")
            if leaf != "weight_scale" or f"{module}.{packed}" not in shapes:
                continue
            parts = {"packed": f"{module}.{packed}", "scale": name}
            if self.format.name == "nvfp4":
                parts["global"] = f"{module}.weight_global_scale" if self.method == "compressed-tensors" else f"{module}.weight_scale_2"
                if parts["global"] not in shapes:
                    raise UserError(f"the base's {module} is stored as NVFP4 without its {parts['global']}")
            *leading, half = shapes[parts["packed"]]
            found[f"{module}.weight"] = QuantizedTensor(self, f"{module}.weight", (*leading, 2 * half), parts)
        return found


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight a release stores quantized: its dense name and shape, and its stored parts."""

    release: Release
    name: str
    shape: Shape
    parts: dict[str, str]  # role ("packed", "scale", "global") -> stored name

    @property
    def gpt_oss(self) -> bool:
        return self.release.method == "mxfp4"

    def steps(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Each block's step (what E2M1's 1.0 is worth there) in float32, by the stored rows:
        ``[rows, blocks]``, or ``[experts, rows, blocks]`` for gpt-oss's experts."""
        scale = read(self.parts["scale"])
        if self.release.format.name == "mxfp4":
            return torch.exp2(scale.float() - 127)
        stored = float(read(self.parts["global"]).float().reshape(-1)[0])
        # compressed-tensors stores the global scale as a divisor, ModelOpt as a multiplier; the
        # block scale times the global first, as engines and ModelOpt do.
        global_scale = 1.0 / stored if self.release.method == "compressed-tensors" else stored
        return scale.float() * torch.tensor(global_scale, dtype=torch.float32)

    def values(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The stored E2M1 values by the stored rows (``[..., rows, columns]``), unscaled."""
        packed = read(self.parts["packed"])
        if self.gpt_oss:  # [experts, rows, blocks, 16] bytes
            packed = packed.reshape(*packed.shape[:2], -1)
        return unpack_e2m1(packed)

    def dequantize(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The weight as the engine dequantizes it, in float32 (every value exact there)."""
        return self.dense(scale_blocks(self.values(read), self.steps(read)))

    def rows(self, dense: torch.Tensor) -> torch.Tensor:
        """A dense weight by the stored rows: gpt-oss stores its experts output-major."""
        return dense.transpose(1, 2) if self.gpt_oss else dense

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.transpose(1, 2) if self.gpt_oss else rows

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """E2M1 values by the stored rows (``values``' layout) as the stored packed tensor."""
        packed = pack_e2m1(values)
        if self.gpt_oss:
            packed = packed.reshape(*packed.shape[:2], -1, GPT_OSS_BLOCK_BYTES)
        return packed


def _gpt_oss_tensors(release: Release, shapes: Mapping[str, Shape]) -> dict[str, QuantizedTensor]:
    found = {}
    for name, shape in shapes.items():
        if not name.endswith("_blocks"):
            continue
        dense, scales = name.removesuffix("_blocks"), name.removesuffix("_blocks") + "_scales"
        if scales not in shapes or len(shape) != 4 or shape[-1] != GPT_OSS_BLOCK_BYTES:
            raise UserError(f"the base's {name} is not gpt-oss's MXFP4 blocks ([experts, rows, blocks, 16] with {scales})")
        experts, rows, blocks, _ = shape
        found[dense] = QuantizedTensor(release, dense, (experts, blocks * 2 * GPT_OSS_BLOCK_BYTES, rows), {"packed": name, "scale": scales})
    return found


def release_of(config: Mapping[str, Any], where: str) -> Release | None:
    """The release ``config`` (a base's config.json, read from ``where``) declares: None for a base
    stored in BF16 or FP32, or in block-scaled FP8 (which ``TensorSource`` reads). Any quantization
    the reader does not know is refused here, before any work, naming what the base declares."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise UserError(f"{where}: config.json's quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and list(qc.get("weight_block_size") or []) == [128, 128]:
        return None
    known = "compressed-tensors nvfp4-pack-quantized or mxfp4-pack-quantized, ModelOpt NVFP4, gpt-oss MXFP4, FP8 in 128x128 blocks"
    if method == "compressed-tensors":
        name = str(qc.get("format", ""))
        fmt = next((f for f in FORMATS.values() if f.e2m1 and f.ct_format == name), None)
        if fmt is None:
            raise UserError(f"{where}: the base is quantized as compressed-tensors' {name or 'unnamed format'}, which fp4prep does not read (it reads {known})")
        return Release(method, fmt, dict(qc))
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise UserError(f"{where}: the base is quantized as ModelOpt's {algo or 'unnamed algorithm'}, which fp4prep does not read (it reads {known})")
        return Release(method, FORMATS["nvfp4"], dict(qc))
    if method == "mxfp4":
        return Release(method, FORMATS["mxfp4"], dict(qc))
    detail = f"{method} with weight blocks {qc.get('weight_block_size')}" if method == "fp8" else method or "an unnamed method"
    raise UserError(f"{where}: the base is quantized as {detail}, which fp4prep does not read (it reads {known})")


class BaseSource(TensorSource):
    """A base checkpoint's tensors by the names and shapes of the dense model: an FP4 release's
    quantized weights dequantized as the engine dequantizes them (its input scales, which the dense
    model has no use for, left out), block-scaled FP8 as ``TensorSource`` reads it, everything else
    as stored. ``raw`` still reads any stored tensor by its stored name."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = release_of(read_config(directory), str(directory))
        stored = super().names()
        shapes = {n: TensorSource.shape(self, n) for n in stored}
        self.quantized = self.release.tensors(shapes) if self.release else {}
        modules = {t.name.rpartition(".")[0] for t in self.quantized.values() if t.name.endswith(".weight")}
        parts = {p for t in self.quantized.values() for p in t.parts.values()}
        kept = [n for n in stored if n not in parts and not (n.rpartition(".")[0] in modules and n.rpartition(".")[2] != "bias")]
        self._names = kept + sorted(self.quantized)

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self.quantized or super().__contains__(name)

    def shape(self, name: str) -> tuple[int, ...]:
        quantized = self.quantized.get(name)
        return quantized.shape if quantized is not None else super().shape(name)

    def get(self, name: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> torch.Tensor:
        quantized = self.quantized.get(name)
        if quantized is None:
            return super().get(name, dtype, device)
        return quantized.dequantize(lambda part: self.raw(part).to(device)).to(dtype)


def weights_format(directory: Path) -> str:
    """How the base at ``directory`` is stored, by its config.json: "bf16" (or any unquantized
    float), "fp8-blocks", or an FP4 release's format ("nvfp4", "mxfp4"). Refuses what the reader
    does not know, as ``release_of`` does."""
    config = read_config(directory)
    release = release_of(config, str(directory))
    if release is not None:
        return release.format.name
    return "fp8-blocks" if config.get("quantization_config") else "bf16"
