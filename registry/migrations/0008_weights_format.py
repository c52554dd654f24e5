"""A catalogue entry says how its base's weights are stored: GLM-5.3's as FP8 blocks, Kimi-K3's as its
MXFP4 release."""

from django.db import migrations, models


def forward(apps, schema_editor):
    SupportedBase = apps.get_model("registry", "SupportedBase")
    SupportedBase.objects.filter(slug="glm-5.3").update(weights_format="fp8-blocks")
    SupportedBase.objects.filter(slug="kimi-k3").update(weights_format="mxfp4")


class Migration(migrations.Migration):
    dependencies = [("registry", "0007_run_settings")]
    operations = [
        migrations.AddField(
            model_name="supportedbase",
            name="weights_format",
            field=models.CharField(
                choices=[("bf16", "BF16"), ("fp8-blocks", "FP8 in 128x128 blocks"), ("nvfp4", "an NVFP4 release"), ("mxfp4", "an MXFP4 release")],
                default="bf16",
                max_length=12,
            ),
        ),
        migrations.AlterField(
            model_name="supportedbase",
            name="weights_location",
            field=models.CharField(
                help_text="The base's weights: a directory under FP4PREP_WEIGHTS_ROOT, an absolute path, or 'embedded:smollm2'",
                max_length=500,
            ),
        ),
        migrations.RunPython(forward, migrations.RunPython.noop),
    ]
