"""Quantize a merged BF16 model with a peer quantizer, inside that quantizer's own environment.

``benchmarks/peers.py`` runs this with the python of the peer's virtual environment (llm-compressor
or AutoRound, each pinned, torch 2.13 kept), so it imports nothing of fp4prep: it reads the merged
model's folder and the calibration sequences fp4prep's recipe calibrates on (a JSON list of token-ID
lists), quantizes, saves the peer's own export (compressed-tensors) and prints one JSON line with
the quantizer's wall time and the process's peak memory.

    python peer_quantize.py TOOL METHOD SCHEME MODEL_DIR SEQUENCES.json OUT_DIR [DTYPE]

DTYPE (``bfloat16``, the default, or ``float32``) is what the model is loaded and calibrated in:
``peers.py`` passes the one fp4prep computes in on this CPU (FP32 where it has no native BF16
arithmetic, where a BF16 matrix product runs tens of times slower), so that times compare.

TOOL ``llmcompressor``: METHOD ``rtn`` (``QuantizationModifier``), ``gptq`` (``GPTQModifier``) or
``awq-gptq`` (``AWQModifier`` then ``GPTQModifier``); SCHEME a compressed-tensors preset (``NVFP4``,
``MXFP4A16``). TOOL ``autoround``: METHOD ``default`` (its 200 iterations) or ``fast`` (50
iterations at its learning rate 5e-3, its "light" setting); SCHEME ``NVFP4`` or ``MXFP4A16``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

# Kept BF16 by every peer as by fp4prep: the output head, MoE routers.
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*router.*"]


def _llmcompressor(model, tokenizer, method: str, scheme: str, sequences: list[list[int]], out: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if method == "awq-gptq":
        # Its AWQ pins cached activations for faster copies to a GPU (``awq/base.py``: ``cache.pin_memory``),
        # unconditionally, and pinning needs an accelerator: on a CPU the copy is skipped, nothing else changes.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)
    data = Dataset.from_dict({"input_ids": sequences, "attention_mask": [[1] * len(s) for s in sequences]})
    if method == "rtn":
        recipe: object = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
    elif method == "gptq":
        recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
    elif method == "awq-gptq":
        recipe = [AWQModifier(), GPTQModifier(targets="Linear", scheme=scheme, ignore=IGNORE)]
    else:
        raise SystemExit(f"llmcompressor: unknown method {method!r} (rtn, gptq, awq-gptq)")
    oneshot(
        model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=len(sequences),
        max_seq_length=max(len(s) for s in sequences), shuffle_calibration_samples=False,
    )
    model.save_pretrained(out, save_compressed=True)


def _autoround(model, tokenizer, method: str, scheme: str, sequences: list[list[int]], out: Path) -> None:
    import torch
    from auto_round import AutoRound
    from auto_round.schemes import QuantizationScheme

    data = [torch.tensor(s).unsqueeze(0) for s in sequences]
    chosen: object = scheme
    if scheme == "MXFP4A16":  # its MXFP4 preset quantizes activations too; fp4prep's MXFP4 is weights only
        chosen = QuantizationScheme.from_dict({"bits": 4, "group_size": 32, "data_type": "mx_fp", "act_bits": 16})
    options = {"iters": 50, "lr": 5e-3} if method == "fast" else {}  # its "light" setting
    rounder = AutoRound(
        model, tokenizer=tokenizer, scheme=chosen, dataset=data, nsamples=len(sequences),
        seqlen=max(len(s) for s in sequences), device_map="cpu", **options,
    )
    rounder.quantize_and_save(str(out), format="llm_compressor")
    # It writes into a folder of its own naming under ``out`` (``<model>-nvfp-w4g16``): moved up, so
    # that ``out`` holds the checkpoint as every other quantizer's does.
    written = [c.parent for c in out.rglob("config.json") if c.parent != out]
    if len(written) == 1:
        for item in written[0].iterdir():
            item.rename(out / item.name)
        written[0].rmdir()


def main(argv: list[str]) -> None:
    tool, method, scheme, model_dir, sequences_file, out = argv[:6]
    import torch

    dtype = getattr(torch, argv[6] if len(argv) > 6 else "bfloat16")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    sequences = json.loads(Path(sequences_file).read_text())
    started = time.perf_counter()
    if tool == "llmcompressor":
        # Fused routed experts (transformers' 3-D expert tensors) loaded as one Linear per expert
        # projection, which its modifiers quantize and its save writes back in the checkpoint's names.
        from llmcompressor.modeling.moe.linearize import load_quantizable_moe

        with load_quantizable_moe():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    {"llmcompressor": _llmcompressor, "autoround": _autoround}[tool](model, tokenizer, method, scheme, sequences, Path(out))
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_bytes": peak}))


if __name__ == "__main__":
    main(sys.argv[1:])
