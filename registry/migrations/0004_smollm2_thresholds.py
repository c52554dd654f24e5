"""The SmolLM2 demo base's parity thresholds, set from figures measured on the demo."""

from django.db import migrations

from registry.catalogue import install


def forward(apps, schema_editor):
    install(apps)


class Migration(migrations.Migration):
    dependencies = [("registry", "0003_weight_shapes")]
    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
