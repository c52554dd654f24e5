"""System checks with stable IDs for settings that parse but can't work (``manage.py check``)."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    problems: list[Any] = []
    root = settings.ARTIFACT_ROOT
    existing = next((p for p in [root, *root.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        problems.append(
            Error(f"FP4PREP_ARTIFACT_ROOT {root} can't be created or written", id="fp4prep.E001",
                  hint="Point FP4PREP_ARTIFACT_ROOT at a writable directory every web process and worker mounts.")
        )
    if settings.HEARTBEAT_TIMEOUT < 2 * settings.HEARTBEAT_INTERVAL:
        problems.append(
            Error(
                f"FP4PREP_HEARTBEAT_TIMEOUT ({settings.HEARTBEAT_TIMEOUT}s) is under twice FP4PREP_HEARTBEAT_INTERVAL "
                f"({settings.HEARTBEAT_INTERVAL}s): live workers would be taken for dead",
                id="fp4prep.E002",
            )
        )
    return problems


@register(Tags.security, deploy=True)
def check_deployment(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``check --deploy``: what the embedded setup is allowed and production is not."""
    problems: list[Any] = []
    engine = settings.DATABASES["default"]["ENGINE"]
    if engine.endswith("sqlite3"):
        problems.append(
            Warning("SQLite in production: workers on other machines can't reach it", id="fp4prep.W001",
                    hint="Set DATABASE_URL to a PostgreSQL database.")
        )
    if not settings.BROKER_URL:
        problems.append(
            Warning("django-q2's ORM broker in production: it polls the database", id="fp4prep.W002",
                    hint="Set FP4PREP_BROKER_URL to a redis:// URL.")
        )
    if settings.SECRET_KEY_GENERATED and not engine.endswith("sqlite3"):
        problems.append(
            Warning("the secret key was generated on this machine: web processes elsewhere have another", id="fp4prep.W003",
                    hint="Set FP4PREP_SECRET_KEY to one long random key shared by every web process.")
        )
    return problems
