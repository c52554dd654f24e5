"""Tiny models and data for the tests: a model of any supported architecture built from a small
config with random weights and our tokenizer, LoRA adapters on it, and calibration conversations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB = 49152  # SmolLM2's tokenizer


def tiny_config(arch: str):
    from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 2,
    }
    # Four routed experts, top-2, one shared; layer 0 dense, layer 1 MoE.
    moe = {
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    }
    if arch == "llama":
        config = LlamaConfig(intermediate_size=128, head_dim=16, **common)
        config.architectures = ["LlamaForCausalLM"]
    elif arch == "glm4_moe":
        config = Glm4MoeConfig(head_dim=16, partial_rotary_factor=0.5, **moe, **common)
        config.architectures = ["Glm4MoeForCausalLM"]
    elif arch == "mixtral":  # hub checkpoints: block_sparse_moe.experts.N.w1/w2/w3; every layer MoE
        config = MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16, **common)
        config.architectures = ["MixtralForCausalLM"]
    elif arch == "qwen3_moe":  # mlp.experts.N.gate_proj/up_proj/down_proj; layer 0 dense
        config = Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16,
            mlp_only_layers=[0], **common,
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    elif arch == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one K/V per head
        config = DeepseekV3Config(
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            **moe,
            **common,
        )
        config.architectures = ["DeepseekV3ForCausalLM"]
    else:
        raise ValueError(arch)
    return config


def save_tiny_base(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.bfloat16)
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def save_adapter(
    base_dir: Path,
    path: Path,
    *,
    targets: list[str],
    r: int = 4,
    alpha: int = 8,
    b_scale: float = 0.02,
    use_rslora: bool = False,
    seed: int = 1,
) -> Path:
    """A PEFT LoRA adapter on ``base_dir`` whose LoRA-B is non-zero, as after training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_scale)
    peft_model.save_pretrained(path)
    return path


def save_expert_adapter(
    base_dir: Path, path: Path, *, r: int = 4, alpha: int = 8, seed: int = 1, b_std: float = 0.02
) -> Path:
    """A PEFT adapter on the routed experts' fused 3-D tensors (``target_parameters``, as PEFT
    trains MoE experts on transformers 5) and on attention, LoRA-B non-zero as after training
    (normal, standard deviation ``b_std``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    peft_model.save_pretrained(path)
    return path


def per_expert_modules(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Every 2-D weight of a checkpoint as a Linear module under its stored name: the modules an
    MoE whose experts are separate Linear layers has (transformers 4's Mixtral, Qwen, DeepSeek)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        if not name.endswith(".weight") or tensor.dim() != 2:
            continue
        *path, leaf, _ = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
        linear.weight.data = tensor.float().clone()
        parent.add_module(leaf, linear)
    return root


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
    with path.open("w") as f:
        for i in range(n):
            question = " ".join(rng.choice(words) for _ in range(12))
            answer = " ".join(rng.choice(words) for _ in range(16))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Question {i}: {question}"},
                            {"role": "assistant", "content": answer},
                        ]
                    }
                )
                + "\n"
            )
    return path
