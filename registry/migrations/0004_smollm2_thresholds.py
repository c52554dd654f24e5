"""The SmolLM2 demo base's parity thresholds, set from figures measured on the demo."""

from django.db import migrations

SETTINGS = {
    "calibration_tokens": 8192,
    "sequence_length": 512,
    "thresholds": {
        "continuation_top1": 0.9,
        "answer_kl": 0.25,
        "identical_greedy": 0.6,
        "adapter_retention": 0.9,
        "reload_max_logit_diff": 0.001,
    },
}


def forward(apps, schema_editor):
    apps.get_model("registry", "SupportedBase").objects.filter(slug="smollm2-135m-instruct").update(recipe=SETTINGS)


class Migration(migrations.Migration):
    dependencies = [("registry", "0003_weight_shapes")]
    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
