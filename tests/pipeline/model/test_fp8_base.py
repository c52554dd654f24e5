"""A base stored as block-scaled FP8 (E4M3 + weight_scale_inv per 128x128 block, as FP8 releases of
large MoE models ship) is dequantized to BF16 before merging."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp4prep.pipeline.model.safetensors import TensorSource, dequantize_fp8_blocks
from tests.tiny import save_adapter

from ..helpers import run_tiny


def to_fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale_inv = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            s = tile.abs().amax().clamp(min=1e-12) / 448
            scale_inv[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def test_block_dequantization_matches_a_block_by_block_loop() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 260) * 0.03
    q, scale_inv = to_fp8_blocks(w)
    got = dequantize_fp8_blocks(q, scale_inv)
    for i in range(3):
        for j in range(3):
            tile = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert torch.equal(got[tile], q[tile].float() * scale_inv[i, j])
    assert float((got - w).abs().max()) < 0.03 * 4 * 0.07  # E4M3 keeps 3 mantissa bits


def test_an_fp8_base_is_dequantized_and_prepared(llama_base: Path, tmp_path: Path) -> None:
    bf16 = {k: v.clone() for k, v in TensorSource(llama_base).items()}
    adapter = save_adapter(llama_base, tmp_path / "adapter", targets=["q_proj", "v_proj"])
    path = llama_base / "model.safetensors"
    weights = load_file(str(path))
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        weights[name], weights[name + "_scale_inv"] = to_fp8_blocks(weights[name])
    save_file(weights, str(path), metadata={"format": "pt"})
    config = json.loads((llama_base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (llama_base / "config.json").write_text(json.dumps(config))

    source = TensorSource(llama_base)
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in source.names()
    q = source.get("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype == torch.bfloat16
    assert float((q.float() - bf16["model.layers.0.self_attn.q_proj.weight"].float()).abs().max()) < 0.01

    out = tmp_path / "out"
    result = run_tiny(llama_base, out, adapter_dir=adapter)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"] == "NVFP4"
    assert result.retention is not None and result.retention.pooled > 0.8
