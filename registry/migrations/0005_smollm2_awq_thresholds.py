"""The SmolLM2 demo base's parity thresholds, set again for the AWQ-lite NVFP4 recipe."""

from django.db import migrations

from registry.catalogue import install


def forward(apps, schema_editor):
    install(apps)


class Migration(migrations.Migration):
    dependencies = [("registry", "0004_smollm2_thresholds")]
    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
