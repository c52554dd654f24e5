"""Where the pipeline computes, and in what precision.

``auto`` takes the first CUDA device when there is one. On CUDA, compute is BF16 and ModelOpt's own
kernels calibrate. On a CPU, compute is FP32 unless the CPU has native BF16 (AVX512-BF16, AMX or
Arm's BF16): without it a BF16 matmul runs tens of times slower than FP32, and BF16 values are exact
in FP32, so nothing is lost by widening. Export casts back to BF16.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


@dataclass(frozen=True)
class Compute:
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.cuda:
            return f"{self.device} ({torch.cuda.get_device_name(self.device)}), {dtype}"
        return f"cpu, {dtype}"


def resolve(spec: str = "auto") -> Compute:
    """The device a ``--device`` value names, and the dtype to compute in there."""
    value = (spec or "auto").strip().lower()
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return Compute(torch.device("cpu"), torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    if value == "cuda" or value.startswith("cuda:"):
        try:
            device = torch.device(value)
        except RuntimeError:
            raise UserError(f"unknown device {spec!r}: use {DEVICE_CHOICES}") from None
        if not torch.cuda.is_available():
            raise UserError(f"device {spec!r} was asked for, but this machine has no usable CUDA device")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return Compute(torch.device("cuda", index), torch.bfloat16)
    raise UserError(f"unknown device {spec!r}: use {DEVICE_CHOICES}")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies BF16 in hardware (so BF16 compute costs no more than FP32)."""
    override = os.environ.get("FP4PREP_CPU_BF16")
    if override in ("0", "1"):
        return override == "1"
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
            break
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` (host: the lesser of RAM and cgroup limit)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo("MemAvailable")
    limit = _cgroup_bytes("memory.max")
    if limit is not None:
        used = _cgroup_bytes("memory.current") or 0
        available = min(available, max(0, limit - used)) if available else max(0, limit - used)
    return available


def _meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_bytes(name: str) -> int | None:
    try:
        text = Path("/sys/fs/cgroup", name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
