"""The supported-base catalogue, its deployment profiles and the public base models."""

from django.db import migrations

from registry.catalogue import install, uninstall


def forward(apps, schema_editor):
    install(apps)


def backward(apps, schema_editor):
    uninstall(apps)


class Migration(migrations.Migration):
    dependencies = [("registry", "0001_initial")]
    operations = [migrations.RunPython(forward, backward)]
