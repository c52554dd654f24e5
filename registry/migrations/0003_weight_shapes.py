"""Catalogue entries record their base's weight shapes, which uploaded adapters are checked against;
the SmolLM2 demo base's are set here."""

from django.db import migrations, models

LAYER = "model.layers.*."
# SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 3 KV heads of 64, vocabulary 49,152, tied head.
SMOLLM2_SHAPES = {
    "layers": 30,
    "tensors": {
        "model.embed_tokens.weight": [49152, 576],
        LAYER + "input_layernorm.weight": [576],
        LAYER + "mlp.down_proj.weight": [576, 1536],
        LAYER + "mlp.gate_proj.weight": [1536, 576],
        LAYER + "mlp.up_proj.weight": [1536, 576],
        LAYER + "post_attention_layernorm.weight": [576],
        LAYER + "self_attn.k_proj.weight": [192, 576],
        LAYER + "self_attn.o_proj.weight": [576, 576],
        LAYER + "self_attn.q_proj.weight": [576, 576],
        LAYER + "self_attn.v_proj.weight": [192, 576],
        "model.norm.weight": [576],
    },
}


def forward(apps, schema_editor):
    apps.get_model("registry", "SupportedBase").objects.filter(slug="smollm2-135m-instruct").update(weight_shapes=SMOLLM2_SHAPES)


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
