"""Benchmark: a model bigger than this machine's memory prepares with a few GB of it.

Writes a random Llama of at least ``--gigabytes`` in BF16 (Llama-3-8B's layer shape: hidden 4096,
intermediate 14336, 32 heads, 8 KV heads; as many layers as it takes), one layer at a time, then
runs the pipeline on it in a child process (NVFP4, small calibration and parity settings: the
point is the memory, and a 2-core CPU computes a 15 B-parameter forward slowly). Prints peak RSS,
time per stage, per-layer time and the bytes read and written, and the disk used.

    .venv/bin/python benchmarks/bigger_than_memory.py [--gigabytes 30] [--dir /path/with/space]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 49152

CHILD = """
import json, sys, time
from fp4prep.pipeline import PipelineConfig, run
started = time.perf_counter()
result = run(PipelineConfig(
    base_dir=sys.argv[1], output_dir=sys.argv[2], work_dir=sys.argv[3], quantization="nvfp4",
    calibration_tokens=512, sequence_length=256, parity_prompts=2, continuation_tokens=4,
    quality_gate=False,
))
print(json.dumps({**result.to_dict(), "wall": time.perf_counter() - started}, default=str))
"""


def layer_params() -> int:
    head_dim = HIDDEN // HEADS
    return 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN


def write_base(path: Path, layers: int) -> None:
    """The random base, written one decoder layer per shard (never whole in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from fp4prep.demo import gguf_path

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    path.mkdir(parents=True)
    config.save_pretrained(path)
    gguf = gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    head_dim = HIDDEN // HEADS
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map = {}
    files = layers + 1
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        print(f"\rwriting the base: layer {i + 1}/{layers}", end="", flush=True)
    rest = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }
    name = f"model-{files:05d}-of-{files:05d}.safetensors"
    save_file(rest, str(path / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    print()


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=30.0, help="BF16 size of the random base (default 30)")
    parser.add_argument("--dir", type=Path, default=None, help="where the base and output go (default: a temp dir)")
    args = parser.parse_args()

    layer_bytes = 2 * layer_params()
    rest_bytes = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    layers = max(1, int((args.gigabytes * 1e9 - rest_bytes) / layer_bytes) + 1)
    root = Path(tempfile.mkdtemp(prefix="fp4prep-big-", dir=args.dir))
    try:
        base = root / "base"
        started = time.perf_counter()
        write_base(base, layers)
        print(f"base: {layers} layers, {du(base) / 1e9:.1f} GB on disk, written in {time.perf_counter() - started:.0f} s")
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal"))
        print(f"this machine: {total / 2**30:.1f} GiB of memory, {os.cpu_count()} CPUs")

        out, work = root / "out", root / "work"
        err = root / "stderr"
        with err.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(base), str(out), str(work)],
                stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT, text=True,
            )
            stdout = proc.stdout.read() if proc.stdout else ""
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"the run failed:\n{err.read_text()[-4000:]}")
        result = json.loads(stdout.strip().splitlines()[-1])
        peak = usage.ru_maxrss * 1024
        stages = result["stage_seconds"]
        print(f"\npeak RSS {peak / 2**30:.2f} GiB (goal < 4 GiB) for a {result['bf16_bytes'] / 1e9:.1f} GB BF16 model")
        print(f"wall {result['wall'] / 60:.1f} min on {result['device']}: " + ", ".join(f"{k} {v:.0f}s" for k, v in stages.items()))
        read = result["bf16_bytes"]
        print(
            f"per layer: calibrating {stages['calibrating'] / layers:.1f} s, exporting {stages['exporting'] / layers:.1f} s; "
            f"reading the base once is {read / 1e9:.1f} GB ({read / layers / 1e6:.0f} MB per layer)"
        )
        print(
            f"disk: base {du(base) / 1e9:.1f} GB, checkpoint {result['output_bytes'] / 1e9:.2f} GB "
            f"({result['output_bytes'] / read:.2f}x), work directory at the end {du(work) / 1e9:.2f} GB"
        )
        print(f"reload difference {result['reload_max_logit_diff']}, parity top-1 on BF16's continuations {result['parity']['continuation_top1']:.3f}")
        if peak >= 4 * 2**30:
            sys.exit("FAILED: peak RSS is 4 GiB or more")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
