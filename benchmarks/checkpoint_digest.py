"""Benchmark: the demo's checkpoints, file by file, as SHA-256 digests: run it before and after a
change that must not change what fp4prep writes, and compare.

Runs the demo job (the demo adapter on the demo base, the demo calibration file, 8,192 calibration
tokens, 4,096 of them the user's) through ``run`` for each format and prints each output file's
digest. ``fp4prep.json`` and ``README.md`` describe the run (lineage, figures, times), not the
checkpoint: their digests are printed apart, ``fp4prep.json`` without its clock-dependent keys.

    .venv/bin/python benchmarks/checkpoint_digest.py [nvfp4 mxfp4 fp8]
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DESCRIBE_THE_RUN = ("fp4prep.json", "README.md")


def digest(path: Path) -> str:
    data = path.read_bytes()
    if path.name == "fp4prep.json":
        lineage = json.loads(data)
        lineage.pop("created_at", None)
        data = json.dumps(lineage, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    from fp4prep import demo
    from fp4prep.pipeline import PipelineConfig, run

    assets = demo.build()
    for quantization in sys.argv[1:] or ["nvfp4", "mxfp4", "fp8"]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / quantization
            result = run(PipelineConfig(
                base_dir=assets.base_dir, adapter_dir=assets.adapter_dir, output_dir=out, quantization=quantization,
                calibration_file=assets.calibration_file, calibration_tokens=8192, user_token_minimum=4096,
            ))
            print(f"{quantization} ({result.device}): answer KL {result.parity.answer_kl:.6f}, "
                  f"continuation top-1 {result.parity.continuation_top1:.4f}")
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                mark = "  (describes the run)" if path.name in DESCRIBE_THE_RUN else ""
                print(f"  {digest(path)[:16]}  {path.relative_to(out)}{mark}", flush=True)


if __name__ == "__main__":
    main()
