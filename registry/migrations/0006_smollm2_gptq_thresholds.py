"""The SmolLM2 demo base's parity thresholds, set again for the NVFP4 recipe with GPTQ."""

from django.db import migrations

from registry.catalogue import install


def forward(apps, schema_editor):
    install(apps)


class Migration(migrations.Migration):
    dependencies = [("registry", "0005_smollm2_awq_thresholds")]
    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
