"""Benchmark: what checking an adapter's rank_pattern costs at upload, worst shapes included.

Each case is packed as an archive and unpacked and checked as a registration does
(``registry.archives.extract``), in a process of its own: the demo adapter (its weights, the
embedded base's table of weight shapes) with a ``rank_pattern`` of 4096 plain module names, of 4096
and of 256 regular expressions, and with keys that repeat into megabytes once compiled
(``(?:x{1024}){1024}``, eight of them, and larger); and an adapter of 781 modules whose names are
2,400 characters long, with 256 keys like ``.*.*[^a.]`` (no base table: the matching itself).
Prints each case's CPU seconds, the memory its process grew by at its peak, and the answer.
Goal: at most 1 s and 64 MiB per upload at any size the limits accept.

    .venv/bin/python benchmarks/pattern_cost.py
"""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def archive(adapter: Path | None, keys: dict[str, int], modules: list[str] | None = None) -> bytes:
    """A .tar.gz of the adapter (or of LoRA matrices for ``modules``) with ``keys`` as its rank_pattern."""
    import torch
    from safetensors.torch import save

    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        weights = (adapter / "adapter_model.safetensors").read_bytes()
    else:
        config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}
        tensors = {
            f"base_model.model.{m}.lora_{k}.weight": torch.zeros(1, 1, dtype=torch.bfloat16) for m in modules or [] for k in "AB"
        }
        weights = save(tensors)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in (("adapter_config.json", json.dumps({**config, "rank_pattern": keys}).encode()),
                           ("adapter_model.safetensors", weights)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _rss_kib() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() // 1024


def _measure(data: bytes, shapes: dict | None, out: Any) -> None:
    from fp4prep.site.errors import ServiceError
    from registry import archives

    before = _rss_kib()
    started = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter.tar.gz"
        path.write_bytes(data)
        try:
            archives.extract(path, Path(tmp) / "out", max_bytes=8 * 1024**3, max_files=1000, base_shapes=shapes)
            outcome = "accepted"
        except ServiceError as exc:
            outcome = f"refused: {exc.message[:60]} ... {exc.message[-70:]}"
        except MemoryError:
            outcome = "MemoryError"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.send((time.process_time() - started, max(peak - before, 0) / 1024, outcome))


def main() -> None:
    import multiprocessing

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fp4prep.site.settings")
    django.setup()
    from fp4prep import demo
    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes

    assets = demo.build()
    shapes = base_weight_shapes(assets.base_dir)
    long_names = [f"model.layers.{i % 30}.{'x' * 2400}_{i}" for i in range(781)]
    cases: list[tuple[str, bytes, dict | None]] = [
        ("4096 plain module names", archive(assets.adapter_dir, {f"layers.{i}.mlp.unused_{i}": 4 for i in range(4096)}), shapes),
        ("4096 regular expressions", archive(assets.adapter_dir, {rf"layers\.{i}\.unused": 4 for i in range(4096)}), shapes),
        ("256 regular expressions", archive(assets.adapter_dir, {rf"layers\.{i}\.unused": 4 for i in range(256)}), shapes),
        ("(?:x{1024}){1024}", archive(assets.adapter_dir, {"(?:x{1024}){1024}": 4}), shapes),
        ("8 keys (?:x{1024}){1024}", archive(assets.adapter_dir, {f"(?:x{{1024}}){{1024}}{i}": 4 for i in range(8)}), shapes),
        ("(?:x{65535}){65535}", archive(assets.adapter_dir, {"(?:x{65535}){65535}": 4}), shapes),
        ("256 x .*.*[^a.], 781 long names", archive(None, {f".*.*[^a.]{i}": 4 for i in range(256)}, long_names), None),
        ("2 x .*.*[^a.]Z, 781 long names", archive(None, {f".*.*[^a.]Z{i}": 1 for i in range(2)}, long_names), None),
        ("4 x .*.*[^a.]Z, 781 long names", archive(None, {f".*.*[^a.]Z{i}": 1 for i in range(4)}, long_names), None),
    ]
    context = multiprocessing.get_context("fork")
    print(f"{'case':<34} {'CPU s':>7} {'peak MiB':>9}  answer")
    for name, data, table in cases:
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_measure, args=(data, table, send))
        child.start()
        cpu, mib, outcome = receive.recv()
        child.join()
        print(f"{name:<34} {cpu:7.2f} {mib:9.1f}  {outcome}")


if __name__ == "__main__":
    main()
