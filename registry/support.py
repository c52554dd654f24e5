"""The ``support`` group: what support staff may see and do in the admin, and nothing more."""

from __future__ import annotations

from typing import Any

SUPPORT_GROUP = "support"
PERMISSIONS = [
    ("jobs", "view_job"),
    ("jobs", "change_job"),  # the cancel and requeue actions
    ("jobs", "view_jobevent"),
    ("jobs", "view_calibrationfile"),
    ("jobs", "view_worker"),
    ("registry", "view_project"),
    ("registry", "change_project"),  # block / unblock (membership is for superusers only)
    ("registry", "view_credittransaction"),
    ("registry", "add_credittransaction"),  # adjustments through the ledger
    ("registry", "view_apikey"),
    ("registry", "change_apikey"),  # revoke
    ("registry", "view_model"),
    ("registry", "view_revision"),
    ("registry", "view_supportedbase"),
    ("registry", "view_deploymentprofile"),
    ("admin", "view_logentry"),  # who did what, and why
]


def ensure_support_group(sender: Any = None, **kwargs: Any) -> None:
    """post_migrate: create the group and give it exactly PERMISSIONS (idempotent)."""
    from django.apps import apps
    from django.contrib.auth.management import create_permissions
    from django.contrib.auth.models import Group, Permission

    for label in ("registry", "jobs", "admin"):
        create_permissions(apps.get_app_config(label), verbosity=0)
    group, _ = Group.objects.get_or_create(name=SUPPORT_GROUP)
    wanted = [Permission.objects.get(content_type__app_label=app, codename=code) for app, code in PERMISSIONS]
    group.permissions.set(wanted)
