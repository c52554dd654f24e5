"""``manage.py createproject NAME --credit USD``: prints {"project_id", "api_key"} as JSON."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from registry.services import create_project


class Command(BaseCommand):
    help = "Create a project with opening credit and print its ID and first API key as JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--credit", default="0", help="opening credit in USD (a ledger grant)")
        parser.add_argument("--member", action="append", default=[], help="username to add as a member (repeatable)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            credit = Decimal(options["credit"])
        except InvalidOperation:
            raise CommandError(f"--credit {options['credit']!r} is not an amount in USD") from None
        if credit < 0:
            raise CommandError("--credit can't be negative")
        users = []
        for username in options["member"]:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"--member {username}: no such user")
            users.append(user)
        project, key = create_project(options["name"], credit)
        project.members.add(*users)
        self.stdout.write(json.dumps({"project_id": project.id, "api_key": key}))
