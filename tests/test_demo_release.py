"""The demo bases' FP4 releases, made the way releases are: MXFP4 in compressed-tensors' layout, every
decoder linear weight of a dense base, only the routed experts of an MoE one (the rest in the
config's ignore list), and the BF16 copy an adapter trained on the release learns on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from fp4prep.demo.release import build_release, dequantize
from fp4prep.pipeline.model.releases import BaseSource
from fp4prep.pipeline.model.safetensors import TensorSource
from tests.tiny import save_tiny_base


def test_a_dense_release_quantizes_every_decoder_projection_and_reads_back_as_its_bf16_copy(tmp_path: Path, tokenizer_dir: Path) -> None:
    base = save_tiny_base(tmp_path / "bf16", "llama", tokenizer_dir)
    build_release(base, tmp_path / "release", experts_only=False)
    config = json.loads((tmp_path / "release" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mxfp4-pack-quantized" and config["ignore"] == ["lm_head"]
    stored = TensorSource(tmp_path / "release").names()
    assert "model.layers.0.mlp.down_proj.weight_packed" in stored and "model.layers.0.mlp.down_proj.weight" not in stored
    assert "model.embed_tokens.weight" in stored  # embeddings and norms as they are
    dequantize(tmp_path / "release", tmp_path / "dequantized")
    release, copy = BaseSource(tmp_path / "release"), TensorSource(tmp_path / "dequantized")
    assert sorted(release.names()) == sorted(copy.names())
    for name in release.names():
        assert torch.equal(release.get(name, torch.bfloat16), copy.get(name, torch.bfloat16)), name
    # Each value on the grid of its block's power-of-two step, the step the block's maximum's.
    original = TensorSource(base).get("model.layers.0.self_attn.q_proj.weight", torch.float32)
    ours = release.get("model.layers.0.self_attn.q_proj.weight", torch.float32)
    assert (ours - original).abs().max() <= original.abs().max() / 4


def test_an_moe_release_quantizes_the_routed_experts_only_and_lists_the_rest_as_ignored(tmp_path: Path, tokenizer_dir: Path) -> None:
    base = save_tiny_base(tmp_path / "bf16", "glm4_moe", tokenizer_dir)
    build_release(base, tmp_path / "release", experts_only=True)
    ignore = json.loads((tmp_path / "release" / "config.json").read_text())["quantization_config"]["ignore"]
    stored = TensorSource(tmp_path / "release").names()
    packed = [n for n in stored if n.endswith("weight_packed")]
    assert packed and all(".mlp.experts." in n for n in packed)
    kept = [n.removesuffix(".weight") for n in stored if n.endswith("proj.weight")]
    assert kept and all(any(re.fullmatch(p.removeprefix("re:"), k) for p in ignore if p.startswith("re:")) for k in kept)
    assert BaseSource(tmp_path / "release").release is not None
