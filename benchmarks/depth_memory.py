"""Benchmark: peak memory does not grow with the model's depth.

Builds random Llamas (hidden 1024, intermediate 2816, SmolLM2's tokenizer), or with ``--arch
glm4_moe`` / ``deepseek_v3`` random Glm4Moe / DeepseekV3 models (hidden 512, 16 routed experts of
256 and a shared one, top-4, layer 0 dense: the layouts GLM and Kimi ship), with 8 and with 48 decoder layers and runs ``fp4prep quantize
--no-quality-gate`` on each in its own process (the format's whole recipe: the AWQ search and GPTQ
on routed experts too). Holding the model whole would add the 40 extra layers' BF16 size (twice during validation);
the pipeline streams one layer at a time, so the 48-layer run should peak less than a quarter of
that above the 8-layer run.

    .venv/bin/python benchmarks/depth_memory.py [--layers 8 48] [--quantization nvfp4] [--arch llama|glm4_moe|deepseek_v3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, INTERMEDIATE = 1024, 2816


def random_moe(path: Path, tokenizer_dir: Path, layers: int, arch: str) -> Path:
    """A random BF16 Glm4Moe or DeepseekV3 (MLA attention) saved as transformers saves it
    (per-expert tensors): hidden 512, 16 routed experts of 256 and a shared one, top-4."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    config = tiny_config(arch)
    config.update({
        "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "num_attention_heads": 8, "num_hidden_layers": layers,
    })
    if arch == "glm4_moe":
        config.update({"num_key_value_heads": 4, "head_dim": 64})
    else:  # MLA: latent ranks and per-head dimensions in DeepSeek-V3's proportions
        config.update({"num_key_value_heads": 8, "q_lora_rank": 192, "kv_lora_rank": 64,
                       "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def weights_bytes(base: Path) -> int:
    return sum(p.stat().st_size for p in base.glob("*.safetensors"))


def tokenizer(directory: Path) -> Path:
    from transformers import AutoTokenizer

    from fp4prep.demo import gguf_path

    gguf = gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(directory)
    return directory


def quantize(base: Path, out: Path, quantization: str, log: Path) -> tuple[int, float, dict]:
    """Peak RSS (bytes), wall seconds and the JSON result of one ``fp4prep quantize`` process."""
    fp4prep = [sys.executable, "-m", "fp4prep.cli"]
    args = ["quantize", "--model-id", str(base), "--output-directory", str(out), "--quantization", quantization,
            "--no-quality-gate", "--quiet", "--json"]
    started = time.perf_counter()
    with log.open("w") as stdout, (log.with_suffix(".err")).open("w") as stderr:
        proc = subprocess.Popen([*fp4prep, *args], stdout=stdout, stderr=stderr, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"fp4prep quantize failed on {base}:\n{log.with_suffix('.err').read_text()[-4000:]}")
    return usage.ru_maxrss * 1024, seconds, json.loads(log.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[8, 48])
    parser.add_argument("--quantization", default="nvfp4", choices=("nvfp4", "mxfp4", "fp8"))
    parser.add_argument("--arch", default="llama", choices=("llama", "glm4_moe", "deepseek_v3"))
    args = parser.parse_args()
    from tests.pipeline.bases import random_llama

    shallow, deep = args.layers
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = tokenizer(work / "tokenizer")
        from fp4prep.pipeline.model.reads import describe

        for layers in (shallow, deep):
            if args.arch == "llama":
                base = random_llama(work / f"base-{layers}", tok, layers, HIDDEN, INTERMEDIATE)
            else:
                base = random_moe(work / f"base-{layers}", tok, layers, args.arch)
            size = weights_bytes(base)
            peak, seconds, result = quantize(base, work / f"out-{layers}", args.quantization, work / f"{layers}.json")
            rows[layers] = (peak, seconds, result, size)
            gptq = result.get("expert_gptq") or {}
            if gptq:
                done, kept = sum(v[0] for v in gptq.values()), sum(v[1] for v in gptq.values())
                print(f"{layers:3d} layers: GPTQ rounded {done} of {done + kept} routed-expert projections", flush=True)
            print(
                f"{layers:3d} layers: BF16 {result['bf16_bytes'] / 2**20:7.0f} MiB, peak RSS {peak / 2**20:6.0f} MiB, "
                f"{seconds:6.1f} s ({', '.join(f'{k} {v:.1f}s' for k, v in result['stage_seconds'].items())}), "
                f"{result['device']}",
                flush=True,
            )
            print(f"{layers:3d} layers: read {describe(result['reads'])}", flush=True)
    extra = rows[deep][3] - rows[shallow][3]  # the extra layers' BF16 bytes on disk
    growth = rows[deep][0] - rows[shallow][0]
    print(f"\nthe {deep - shallow} extra layers hold {extra / 2**20:.0f} MiB in BF16")
    print(f"peak RSS grew by {growth / 2**20:.0f} MiB = {growth / extra:.2f} of that (goal < 0.25)")
    if growth >= extra / 4:
        sys.exit("FAILED: peak memory grows with depth")


if __name__ == "__main__":
    main()
