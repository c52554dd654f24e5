"""Benchmark: the CPU backend's fake quantization, eager torch against the fused (compiled) path.

Calibration searches (AWQ's alphas) and every quantized forward of validation fake-quantize each
activation and weight they touch; in eager torch that costs as much as the matmul it feeds. Prints
values per second for each path, format and dtype (FP32, and BF16 as a layer computes where the CPU
multiplies it natively), the matmul beside them, and the one-off compile time.

    .venv/bin/python benchmarks/fake_quant_speed.py [--tokens 2048] [--features 576]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp4prep.pipeline.formats import engine, numerics  # noqa: E402


def seconds(fn: Callable[[], object], repeat: int = 10) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="one calibration batch: 4 sequences of 512")
    parser.add_argument("--features", type=int, default=576, help="SmolLM2-135M's hidden size")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.features)
    weight = torch.randn(4 * args.features, args.features)
    amax = x.abs().amax()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; activations {args.tokens} x {args.features}")

    started = time.perf_counter()
    numerics.nvfp4_fake_quant(x, 16, amax)
    numerics.mxfp4_fake_quant(x, 32)
    print(f"first compiled calls (compile, or load from the on-disk cache): {time.perf_counter() - started:.1f} s")
    if not (numerics.nvfp4_fake_quant.available and numerics.mxfp4_fake_quant.available):
        print("compiling is unavailable here: both rows below are eager")

    global_scale = engine.nvfp4_global_scale_of(amax)
    print("\n| format | dtype | eager | compiled | speed-up |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        values = x.to(dtype)
        cases: dict[str, tuple[Callable[..., torch.Tensor], tuple[object, ...]]] = {
            "nvfp4": (numerics.nvfp4_fake_quant, (16, amax)),
            "mxfp4": (numerics.mxfp4_fake_quant, (32,)),
            "nvfp4 inputs (the engine's)": (engine.nvfp4_activations, (global_scale, 16)),
        }
        for name, (fn, rest) in cases.items():
            eager = seconds(partial(fn.eager, values, *rest))  # type: ignore[attr-defined]
            compiled = seconds(partial(fn, values, *rest))
            rates = f"{x.numel() / eager / 1e6:.0f} M values/s | {x.numel() / compiled / 1e6:.0f} M values/s"
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {rates} | {eager / compiled:.1f}x |")
    matmul = seconds(lambda: x @ weight.T)
    print(f"\nfor scale: the matmul this activation feeds ({weight.shape[0]} outputs) takes {matmul * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
