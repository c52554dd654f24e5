"""The supported-base catalogue, its deployment profiles and the public base models, as shipped
first. The rows are held here: what this migration installs never changes. Later edits come in
later migrations or through ``manage.py catalogue``."""

import secrets
import string
from decimal import Decimal

from django.db import migrations

CATALOGUE = [
    {
        "slug": "glm-5.3",
        "family": "GLM-5.3",
        # Adapters saved before 2026-10-09 record the NVFP4 release as their base.
        "accepted_base_ids": ["zai-org/GLM-5.3-FP8", "zai-org/GLM-5.3-NVFP4"],
        "served_base_id": "zai-org/GLM-5.3-NVFP4",
        "quantization": "nvfp4",
        "recipe": {"calibration_tokens": 1196032, "sequence_length": 4096},
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
        "recipe": {"calibration_tokens": 1196032, "sequence_length": 4096},
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
        "recipe": {"calibration_tokens": 8192, "sequence_length": 512},
        "user_token_minimum": 4096,
        "typical_hours": Decimal("0.05"),
        "gpu_count": 0,
        "price_per_gpu_hour": Decimal("2.00"),
        "worker_kind": "cpu",
        "weights_location": "embedded:smollm2",
        "profiles": [("cr_SmoLm2Nvfp4RtxPro6000", "SmolLM2 NVFP4 on 1x RTX PRO 6000", "NVIDIA RTX PRO 6000 Blackwell", 1, "nvfp4")],
    },
]

BASES = [
    ("zai-org/GLM-5.3-FP8", "glm-5.3"),
    ("zai-org/GLM-5.3-NVFP4", "glm-5.3"),
    ("moonshotai/Kimi-K3", "kimi-k3"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
]


def forward(apps, schema_editor):
    SupportedBase = apps.get_model("registry", "SupportedBase")
    DeploymentProfile = apps.get_model("registry", "DeploymentProfile")
    Model = apps.get_model("registry", "Model")
    for entry in CATALOGUE:
        entry = dict(entry)
        profiles = entry.pop("profiles")
        base, _ = SupportedBase.objects.update_or_create(slug=entry.pop("slug"), defaults=entry)
        for pk, name, hardware, gpus, quantization in profiles:
            DeploymentProfile.objects.update_or_create(
                id=pk,
                defaults={"supported_base": base, "name": name, "hardware": hardware, "gpu_count": gpus, "quantization": quantization},
            )
    for name, slug in BASES:
        if not Model.objects.filter(project__isnull=True, kind="base", name=name).exists():
            model_id = "ml_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(20))
            Model.objects.create(id=model_id, kind="base", name=name, base_model=name, supported_base_id=slug)


def backward(apps, schema_editor):
    apps.get_model("registry", "Model").objects.filter(project__isnull=True, kind="base").delete()
    apps.get_model("registry", "SupportedBase").objects.filter(slug__in=[e["slug"] for e in CATALOGUE]).delete()


class Migration(migrations.Migration):
    dependencies = [("registry", "0001_initial")]
    operations = [migrations.RunPython(forward, backward)]
