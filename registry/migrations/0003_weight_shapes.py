"""Catalogue entries record their base's weight shapes, which uploaded adapters are checked against."""

from django.db import migrations, models

from registry.catalogue import install


def forward(apps, schema_editor):
    install(apps)


class Migration(migrations.Migration):
    dependencies = [("registry", "0002_catalogue")]
    operations = [
        migrations.AddField(
            model_name="supportedbase",
            name="weight_shapes",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(forward, migrations.RunPython.noop),
    ]
