"""A catalogue entry's fixed run settings are its run_settings (the recipe is the format's own)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("registry", "0006_smollm2_gptq_thresholds")]
    operations = [migrations.RenameField("supportedbase", "recipe", "run_settings")]
