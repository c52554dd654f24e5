"""The shipped supported-base catalogue: entries, deployment profiles and public base models.

Data, not code paths. The migrations hold the rows as they shipped them (what an old migration
installs never changes); ``manage.py catalogue`` brings a database to the entries here, each one
checked as it is saved; support staff edit entries in the admin.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any


def _llama_shapes(layers: int, hidden: int, intermediate: int, kv_width: int, vocab: int) -> dict[str, Any]:
    """The weight shapes of a Llama-architecture checkpoint with tied embeddings."""
    layer = "model.layers.*."
    return {
        "layers": layers,
        "tensors": {
            "model.embed_tokens.weight": [vocab, hidden],
            layer + "input_layernorm.weight": [hidden],
            layer + "mlp.down_proj.weight": [hidden, intermediate],
            layer + "mlp.gate_proj.weight": [intermediate, hidden],
            layer + "mlp.up_proj.weight": [intermediate, hidden],
            layer + "post_attention_layernorm.weight": [hidden],
            layer + "self_attn.k_proj.weight": [kv_width, hidden],
            layer + "self_attn.o_proj.weight": [hidden, hidden],
            layer + "self_attn.q_proj.weight": [hidden, hidden],
            layer + "self_attn.v_proj.weight": [kv_width, hidden],
            "model.norm.weight": [hidden],
        },
    }


# GLM-5.3's and Kimi-K3's weight shapes are filled from their weights where a worker has them
# (`manage.py baseshapes glm-5.3`); until then their adapters' shapes are checked when a job merges.
# Their jobs are held to their format recipe's thresholds (fp4prep/pipeline/recipes.py) until
# BF16-vs-FP4 figures measured on their own weights set bars of their own here.
CATALOGUE: list[dict[str, Any]] = [
    {
        "slug": "glm-5.3",
        "family": "GLM-5.3",
        # Adapters saved before 2026-10-09 record the NVFP4 release as their base.
        "accepted_base_ids": ["zai-org/GLM-5.3-FP8", "zai-org/GLM-5.3-NVFP4"],
        "served_base_id": "zai-org/GLM-5.3-NVFP4",
        "quantization": "nvfp4",
        "run_settings": {"calibration_tokens": 1196032, "sequence_length": 4096},
        "user_token_minimum": 598016,
        "typical_hours": Decimal("6"),
        "gpu_count": 8,
        "price_per_gpu_hour": Decimal("0.8988"),
        "worker_kind": "gpu",
        "weights_location": "zai-org/GLM-5.3-FP8",
        "weights_format": "fp8-blocks",
        "profiles": [("cr_Cf3yApYdaWMrH6RsyVmh7", "GLM-5.3 NVFP4 on 4x B200", "NVIDIA B200", 4, "nvfp4")],
    },
    {
        "slug": "kimi-k3",
        "family": "Kimi-K3",
        "accepted_base_ids": ["moonshotai/Kimi-K3"],
        "served_base_id": "moonshotai/Kimi-K3",  # the release's own MXFP4
        "quantization": "mxfp4",
        "run_settings": {"calibration_tokens": 1196032, "sequence_length": 4096},
        "user_token_minimum": 598016,
        "typical_hours": Decimal("18"),
        "gpu_count": 8,
        "price_per_gpu_hour": Decimal("0.8988"),
        "worker_kind": "gpu",
        # The release itself: MXFP4 routed experts, the rest as it ships; read as the engine dequantizes it.
        "weights_location": "moonshotai/Kimi-K3",
        "weights_format": "mxfp4",
        "profiles": [("cr_CfsRY8rFVfgH9cEWwywEa", "Kimi-K3 MXFP4 on 8x B200", "NVIDIA B200", 8, "mxfp4")],
    },
    {
        "slug": "smollm2-135m-instruct",
        "family": "SmolLM2-135M-Instruct",
        "accepted_base_ids": ["HuggingFaceTB/SmolLM2-135M-Instruct"],
        "served_base_id": "fp4prep/SmolLM2-135M-Instruct-NVFP4",
        "quantization": "nvfp4",
        # Measured on the demo with the NVFP4 recipe (benchmarks/parity_bars.py, BF16 merged vs
        # checkpoint, 16 held-back conversations as a job measures them): sound checkpoints of both
        # adapters score top-1 on the BF16 model's continuations 0.992-1.0 and KL on the answers
        # 0.022-0.068. Damaged ones: the adapter lost, top-1 0.35-0.72 and KL 0.95-1.8; one layer's
        # down_proj scrambled (layers 0-29), top-1 0.004-0.961 and KL 0.085-12. No one figure
        # separates them (orders, layer 12: KL 0.085; layer 24: top-1 0.961), the two together do:
        # top-1 at least 0.96 (5x the worst sound disagreement, 0.008) and KL at most 0.12 (1.75x
        # the worst sound KL). tests/pipeline/validation/test_parity_gate.py checks both sides on the demo.
        "run_settings": {
            "calibration_tokens": 8192,
            "sequence_length": 512,
            "thresholds": {
                "continuation_top1": 0.96,
                "answer_kl": 0.12,
                "identical_greedy": 0.6,
                "adapter_retention": 0.9,
                "reload_max_logit_diff": 1e-3,
            },
        },
        "user_token_minimum": 4096,
        "typical_hours": Decimal("0.05"),
        "gpu_count": 0,
        "price_per_gpu_hour": Decimal("2.00"),
        "worker_kind": "cpu",
        "weights_location": "embedded:smollm2",
        "weights_format": "bf16",
        # SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 3 KV heads of 64, vocabulary 49,152, tied head.
        "weight_shapes": _llama_shapes(30, 576, 1536, 192, 49152),
        "profiles": [("cr_SmoLm2Nvfp4RtxPro6000", "SmolLM2 NVFP4 on 1x RTX PRO 6000", "NVIDIA RTX PRO 6000 Blackwell", 1, "nvfp4")],
    },
]

BASES: list[tuple[str, str]] = [
    ("zai-org/GLM-5.3-FP8", "glm-5.3"),
    ("zai-org/GLM-5.3-NVFP4", "glm-5.3"),
    ("moonshotai/Kimi-K3", "kimi-k3"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
]


def install(check_only: bool = False) -> list[str]:
    """Create or update the shipped entries, their profiles and the public base models (idempotent);
    returns what changed, a line each (with ``check_only``, what would). A row that fails its
    checks raises ValidationError naming the entry and the field."""
    from django.core.exceptions import ValidationError
    from django.db import transaction

    from .models import DeploymentProfile, Model, SupportedBase

    changes: list[str] = []
    with transaction.atomic():
        for entry in CATALOGUE:
            entry = dict(entry)
            profiles, slug = entry.pop("profiles"), entry.pop("slug")
            base = SupportedBase.objects.filter(slug=slug).first() or SupportedBase(slug=slug)
            differ = [k for k, v in entry.items() if getattr(base, k, None) != v]
            if base._state.adding or differ:
                changes.append(f"{slug}: " + ("new entry" if base._state.adding else "sets " + ", ".join(differ)))
                for key, value in entry.items():
                    setattr(base, key, value)
                if not check_only:
                    try:
                        base.full_clean()
                        base.save()
                    except ValidationError as exc:
                        raise ValidationError(f"catalogue entry {slug}: {exc.message_dict}") from None
            for pk, name, hardware, gpus, quantization in profiles:
                wanted = {"supported_base_id": slug, "name": name, "hardware": hardware, "gpu_count": gpus, "quantization": quantization}
                profile = DeploymentProfile.objects.filter(pk=pk).first()
                if profile is None or any(getattr(profile, k) != v for k, v in wanted.items()):
                    changes.append(f"{slug}: profile {pk} {'added' if profile is None else 'updated'}")
                    if not check_only:
                        DeploymentProfile.objects.update_or_create(id=pk, defaults=wanted)
        for name, slug in BASES:
            if not Model.objects.filter(project__isnull=True, kind="base", name=name).exists():
                changes.append(f"{slug}: public base model {name} added")
                if not check_only:
                    Model.objects.create(kind="base", name=name, base_model=name, supported_base_id=slug)
    return changes
