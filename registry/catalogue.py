"""The shipped supported-base catalogue: entries, deployment profiles and public base models.

Data, not code paths: the migration installs it, support staff edit it in the admin.
"""

from decimal import Decimal
from typing import Any

from fp4prep import ids


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
        "weights_location": "moonshotai/Kimi-K3",
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
        # the worst sound KL). tests/pipeline/test_parity_gate.py checks both sides on the demo.
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


def install(apps: Any) -> None:
    """Create or update the shipped entries (idempotent); ``apps`` is a migration's or the live registry."""
    SupportedBase = apps.get_model("registry", "SupportedBase")
    DeploymentProfile = apps.get_model("registry", "DeploymentProfile")
    Model = apps.get_model("registry", "Model")
    # An earlier migration's model lacks the fields added since: give it only the ones it has.
    fields = {f.name for f in SupportedBase._meta.get_fields()}
    for entry in CATALOGUE:
        entry = dict(entry)
        profiles = entry.pop("profiles")
        slug = entry.pop("slug")
        defaults = {k: v for k, v in entry.items() if k in fields}
        base, _ = SupportedBase.objects.update_or_create(slug=slug, defaults=defaults)
        for pk, name, hardware, gpus, quantization in profiles:
            DeploymentProfile.objects.update_or_create(
                id=pk,
                defaults={"supported_base": base, "name": name, "hardware": hardware, "gpu_count": gpus, "quantization": quantization},
            )
    for name, slug in BASES:
        if not Model.objects.filter(project__isnull=True, kind="base", name=name).exists():
            Model.objects.create(id=ids.model_id(), kind="base", name=name, base_model=name, supported_base_id=slug)


def uninstall(apps: Any) -> None:
    apps.get_model("registry", "Model").objects.filter(project__isnull=True, kind="base").delete()
    apps.get_model("registry", "SupportedBase").objects.filter(slug__in=[e["slug"] for e in CATALOGUE]).delete()
