"""The mixture-of-experts demo base: a dense Llama upcycled into a Mixtral MoE answers as it did."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp4prep.demo import moe as demo_moe

from .tiny import save_tiny_base


def test_upcycling_keeps_the_dense_models_function_and_gives_each_expert_its_own_weights(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    dense_dir = save_tiny_base(tmp_path / "base", "llama", tokenizer_dir)
    moe_dir = tmp_path / "moe"
    demo_moe.build_base(dense_dir, moe_dir)
    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (demo_moe.EXPERTS, demo_moe.TOP_K)

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    tokens = torch.randint(0, dense.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = dense(tokens).logits, moe(tokens).logits
        # Whichever two experts a token goes to, their weights sum to 1 and each computes the MLP.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

        # Sparse routing: each expert sees some tokens and not all of them.
        hidden = moe.model.embed_tokens(tokens).reshape(-1, config["hidden_size"])
        _, _, chosen = moe.model.layers[0].mlp.gate(moe.model.layers[0].post_attention_layernorm(hidden))
        counts = torch.bincount(chosen.flatten(), minlength=demo_moe.EXPERTS)
        assert bool((counts > 0).all()) and bool((counts < tokens.numel()).all()), counts

    # Each expert is the MLP under its own permutation: the same rows, grouped differently.
    experts = moe.model.layers[0].mlp.experts
    inner = config["intermediate_size"]
    gate = dense.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(experts.gate_up_proj[0, :inner], gate)
    for e in range(1, demo_moe.EXPERTS):
        assert not torch.equal(experts.gate_up_proj[e, :inner], gate)
        assert torch.equal(experts.gate_up_proj[e, :inner].sort(0).values, gate.sort(0).values)
