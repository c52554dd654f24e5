"""Benchmark: what checking an adapter's rank_pattern costs at upload, on the demo adapter.

The demo adapter (its weights and config, the embedded base's table of weight shapes) is packed
three times with a ``rank_pattern`` of 4096 plain module names, of 4096 regular expressions and of
256 regular expressions, and each archive is unpacked and checked as a registration does
(``registry.archives.extract``). Prints the seconds each took and whether it was accepted.

    .venv/bin/python benchmarks/pattern_cost.py
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def archive(adapter: Path, keys: dict[str, int]) -> bytes:
    config = json.loads((adapter / "adapter_config.json").read_text())
    data = json.dumps({**config, "rank_pattern": keys}).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("adapter_config.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.add(adapter / "adapter_model.safetensors", arcname="adapter_model.safetensors")
    return buffer.getvalue()


def main() -> None:
    from fp4prep import demo
    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
    from fp4prep.site.errors import ServiceError
    from registry import archives

    assets = demo.build()
    shapes = base_weight_shapes(assets.base_dir)
    cases = {
        "4096 plain module names": {f"layers.{i}.mlp.unused_{i}": 4 for i in range(4096)},
        "4096 regular expressions": {rf"layers\.{i}\.unused": 4 for i in range(4096)},
        "256 regular expressions": {rf"layers\.{i}\.unused": 4 for i in range(256)},
    }
    for name, keys in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "adapter.tar.gz"
            path.write_bytes(archive(assets.adapter_dir, keys))
            started = time.perf_counter()
            try:
                archives.extract(path, Path(tmp) / "out", max_bytes=8 * 1024**3, max_files=1000, base_shapes=shapes)
                outcome = "accepted"
            except ServiceError as exc:
                outcome = f"refused: {exc.message[:90]}"
            print(f"{name:<26} {time.perf_counter() - started:6.2f} s  {outcome}")


if __name__ == "__main__":
    main()
