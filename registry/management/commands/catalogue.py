"""``manage.py catalogue [--check]``: bring the database's catalogue to the shipped entries."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from registry.catalogue import install


class Command(BaseCommand):
    help = (
        "Create or update the shipped supported-base entries, their deployment profiles and the public base "
        "models (registry/catalogue.py), each checked as it is saved; prints what changed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the database differs")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            changes = install(check_only=options["check"])
        except ValidationError as exc:
            raise CommandError(exc.messages[0]) from None
        for line in changes:
            self.stdout.write(("would change " if options["check"] else "") + line)
        if not changes:
            self.stdout.write("The catalogue is as shipped.")
        elif options["check"]:
            raise CommandError(f"{len(changes)} difference(s) from the shipped catalogue; `manage.py catalogue` applies them")
