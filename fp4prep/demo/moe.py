"""A mixture-of-experts demo base with real weights, built from the dense demo base offline.

What the recipe must handle on the catalogue's bases (routed experts, sparse routing, LoRA on fused
expert tensors) measured on weights that answer like a trained model, not on random ones:

- Base: transformers' Mixtral architecture (every decoder layer an MoE, fused ``gate_up_proj`` /
  ``down_proj`` expert tensors) with SmolLM2-135M-Instruct's attention, norms and embeddings, and
  four routed experts per layer, top-2. Each expert is the dense MLP "upcycled": its own
  permutation of the MLP's intermediate neurons. A permutation leaves the MLP's function unchanged
  (so the model answers exactly as the dense one does, whichever experts a token is routed to) but
  regroups ``down_proj``'s inputs into different quantization blocks, so the experts' rounding
  differs. The router is seeded Gaussian, so each expert sees its own share of the tokens.
- Adapter: a PEFT LoRA on the task, on attention and on the fused expert tensors
  (``target_parameters``), so after merging every expert differs from the others.
- Calibration and evaluation files: the dense demo's for the same task.

Cached under ``FP4PREP_DATA_DIR`` like the dense demo, in a folder named after a digest of the code
that builds it (this module, ``demo`` and ``demo.tasks``)::

    .venv/bin/python -m fp4prep.demo.moe [--task sentiment|orders]
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from fp4prep import demo
from fp4prep.demo import DemoAssets
from fp4prep.demo.tasks import SENTIMENT, Task
from fp4prep.pipeline.config import EVAL_FILE

logger = logging.getLogger(__name__)

VERSION = "moe-v1"
EXPERTS = 4
TOP_K = 2
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def moe_dir() -> Path:
    """Where the MoE assets are cached: named after the dense demo's builder digest and this module."""
    digest = hashlib.sha256(demo._builder_digest().encode() + Path(__file__).read_bytes())
    return demo.data_dir() / f"{VERSION}-{digest.hexdigest()[:12]}"


def build_base(dense_dir: Path, target: Path, seed: int = 0) -> None:
    """The dense demo base upcycled into a Mixtral MoE (see the module's docstring)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    dense = json.loads((dense_dir / "config.json").read_text())
    config = MixtralConfig(
        vocab_size=dense["vocab_size"],
        hidden_size=dense["hidden_size"],
        intermediate_size=dense["intermediate_size"],
        num_hidden_layers=dense["num_hidden_layers"],
        num_attention_heads=dense["num_attention_heads"],
        num_key_value_heads=dense["num_key_value_heads"],
        head_dim=dense.get("head_dim") or dense["hidden_size"] // dense["num_attention_heads"],
        hidden_act=dense["hidden_act"],
        max_position_embeddings=dense["max_position_embeddings"],
        rms_norm_eps=dense["rms_norm_eps"],
        rope_parameters=dense.get("rope_parameters") or {"rope_type": "default", "rope_theta": dense["rope_theta"]},
        tie_word_embeddings=dense["tie_word_embeddings"],
        bos_token_id=dense["bos_token_id"],
        eos_token_id=dense["eos_token_id"],
        pad_token_id=dense.get("pad_token_id"),
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=None,
        output_router_logits=False,
    )
    config.architectures = ["MixtralForCausalLM"]
    state: dict[str, torch.Tensor] = {}
    for path in sorted(dense_dir.glob("*.safetensors")):
        state.update(load_file(path))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in state.items():
        if ".mlp." not in name:
            weights[name] = tensor
    hidden, inner = config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp."
        gate, up, down = (state[f"{prefix}{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        gate_up, downs = [], []
        for expert in range(EXPERTS):
            order = torch.arange(inner) if expert == 0 else torch.randperm(inner, generator=generator)
            gate_up.append(torch.cat([gate[order], up[order]]))
            downs.append(down[:, order])
        weights[f"{prefix}experts.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{prefix}experts.down_proj"] = torch.stack(downs)
        router = torch.randn(EXPERTS, hidden, generator=generator) / hidden**0.5
        weights[f"{prefix}gate.weight"] = router.to(torch.bfloat16)
    model = MixtralForCausalLM(config).bfloat16()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"upcycling left missing {missing} and unexpected {unexpected}")
    model.tie_weights()
    demo.save_base(model, AutoTokenizer.from_pretrained(dense_dir), target)


def build(force: bool = False, task: Task = SENTIMENT) -> DemoAssets:
    """Build (or reuse) the MoE base and its adapter for ``task``; returns where they are."""
    root = moe_dir()
    if force:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    dense = demo.build(task=task)
    own = root / "tasks" / task.name
    assets = DemoAssets(root / "base", own / "adapter", dense.calibration_file, own / "adapter" / EVAL_FILE)
    started = time.perf_counter()
    if not (assets.base_dir / "config.json").is_file():
        logger.info("building the MoE demo base in %s", assets.base_dir)
        build_base(dense.base_dir, assets.base_dir)
    if not (assets.adapter_dir / "adapter_model.safetensors").is_file():
        logger.info("training the %s adapter on the MoE in %s", task.name, assets.adapter_dir)
        assets.adapter_dir.parent.mkdir(parents=True, exist_ok=True)
        demo.train_adapter(assets.base_dir, assets.adapter_dir, task, target_parameters=EXPERT_TENSORS)
    logger.info("MoE demo assets ready in %.1fs", time.perf_counter() - started)
    return assets


def main(argv: list[str] | None = None) -> None:
    demo.cli("Build the mixture-of-experts demo base and adapter.", build, argv)


if __name__ == "__main__":
    main()
