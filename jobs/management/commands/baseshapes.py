"""``manage.py baseshapes SLUG [--weights DIR]``: record a catalogue entry's weight shapes from its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from fp4prep.pipeline.errors import UserError
from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
from jobs.worker import weights_dir
from registry.models import SupportedBase


class Command(BaseCommand):
    help = (
        "Read a catalogue entry's base checkpoint (config.json and safetensors headers, not the weights) "
        "and store its weight shapes, which uploaded adapters are then checked against."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="the catalogue entry, e.g. glm-5.3")
        parser.add_argument("--weights", type=Path, help="the checkpoint directory (default: the entry's weights location)")

    def handle(self, *args: Any, **options: Any) -> None:
        base = SupportedBase.objects.filter(slug=options["slug"]).first()
        if base is None:
            known = ", ".join(SupportedBase.objects.values_list("slug", flat=True))
            raise CommandError(f"no catalogue entry {options['slug']!r}; the entries are {known}")
        directory = options["weights"] or weights_dir(base)
        try:
            shapes = base_weight_shapes(Path(directory))
        except (UserError, OSError, ValueError) as exc:
            raise CommandError(f"{directory}: {exc}") from None
        base.weight_shapes = shapes
        base.save(update_fields=["weight_shapes"])
        self.stdout.write(f"{base.family}: {shapes['layers']} layers, {len(shapes['tensors'])} tensor shapes recorded")
