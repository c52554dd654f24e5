"""Bases of a chosen size: random Llamas on disk, and sparse ones whose files hold only a header.

A sparse base declares tensors of any size without using the disk (the file is a hole after its
header): the pipeline reads shapes from headers before it reads any data, so such a base reaches
exactly the checks that must refuse it before work starts.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

VOCAB = 49152  # SmolLM2's tokenizer


def llama_config(layers: int, hidden: int, intermediate: int, heads: int = 8) -> object:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def random_llama(path: Path, tokenizer_dir: Path, layers: int, hidden: int, intermediate: int, seed: int = 0) -> Path:
    """A random BF16 Llama written layer by layer, never whole in memory."""
    from safetensors.torch import save_file

    config = llama_config(layers, hidden, intermediate)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    shapes = _shapes(config)
    weight_map = {}
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[name] = shape
    for i, group in enumerate(groups.values()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                std = 0.02 if len(shape) == 2 else 1.0
                tensors[name] = (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
            weight_map[name] = file
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _copy_tokenizer(tokenizer_dir, path)
    return path


def sparse_llama(path: Path, tokenizer_dir: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """A Llama of any size whose safetensors file is a header followed by a hole (reads give zeros)."""
    config = llama_config(layers, hidden, intermediate)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    header: dict[str, object] = {}
    offset = 0
    for name, shape in _shapes(config).items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with (path / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    _copy_tokenizer(tokenizer_dir, path)
    return path


def _shapes(config: object) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _copy_tokenizer(tokenizer_dir: Path, path: Path) -> None:
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)


def gpt_oss_release(path: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """A tiny random gpt-oss model as OpenAI's releases ship it (routed experts in ``*_blocks`` /
    ``*_scales``, MXFP4 rounded to nearest, everything else BF16) in ``path/release``, and its weights
    dequantized in ``path/dense``: what an adapter trained on the release learned on."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig

    from fp4prep.pipeline.formats.numerics import e2m1_round, mxfp4_exponents, pack_e2m1
    from fp4prep.pipeline.model.releases import BaseSource

    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=2, layer_types=["full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    dense, release = path / "dense", path / "release"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(release)
    _copy_tokenizer(tokenizer_dir, release)
    stored = {}
    for name, tensor in load_file(str(release / "model.safetensors")).items():
        if ".experts." not in name or name.endswith("_bias"):
            stored[name] = tensor
            continue
        rows = tensor.float().transpose(1, 2)  # stored output-major: [experts, outputs, inputs]
        exponents = mxfp4_exponents(rows, 32)
        blocks = rows.reshape(*exponents.shape, 32) / torch.exp2(exponents).unsqueeze(-1)
        packed = pack_e2m1(e2m1_round(blocks, ties_to_even=False).reshape(rows.shape))
        stored[f"{name}_blocks"] = packed.reshape(*packed.shape[:2], -1, 16)
        stored[f"{name}_scales"] = (exponents + 127).to(torch.uint8)
    save_file(stored, str(release / "model.safetensors"), metadata={"format": "pt"})
    declared = json.loads((release / "config.json").read_text())
    declared["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (release / "config.json").write_text(json.dumps(declared, indent=2))
    shutil.copytree(release, dense)
    source = BaseSource(release)
    save_file({n: source.get(n).contiguous() for n in source.names()}, str(dense / "model.safetensors"), metadata={"format": "pt"})
    declared.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(declared, indent=2))
    return release, dense
