"""Verbs on the registry that span models: projects with their first key, adapter registration."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from fp4prep.site.errors import InvalidInput, TooLarge, check_length
from fp4prep.text import format_bytes

from . import archives
from .artifacts import manifest, store_revision
from .models import ApiKey, Model, Project, Revision, SupportedBase, get_model


def create_project(name: str, credit: Decimal = Decimal(0), user: Any = None) -> tuple[Project, str]:
    """A project, its opening credit as a ledger grant, and its first API key (returned raw, once)."""
    with transaction.atomic():
        project = Project.objects.create(name=name)
        if user is not None:
            project.members.add(user)
        if credit:
            project.add_credit(credit, "opening credit", user, kind="grant")
        _, raw = ApiKey.issue(project, "default")
    return project, raw


def storage_left(project: Project) -> int:
    return max(settings.PROJECT_STORAGE_BYTES - project.stored_bytes(), 0)


def claim_storage(project: Project, size: int, what: str) -> None:
    """Inside the transaction that writes the upload's row: lock the project's row and check that
    ``size`` more bytes fit. Uploads into one project commit one at a time, each counting those
    before it, so four at once can't each fit the same space (the check before unpacking only
    spares a doomed upload the work)."""
    assert transaction.get_connection().in_atomic_block, "claim_storage must run inside the upload's transaction"
    Project.objects.select_for_update().filter(pk=project.pk).first()
    if project.stored_bytes() + size > settings.PROJECT_STORAGE_BYTES:
        raise quota_exceeded(project, what)


def quota_exceeded(project: Project, what: str) -> TooLarge:
    used, quota = project.stored_bytes(), settings.PROJECT_STORAGE_BYTES
    return TooLarge(
        f"Project {project.id} has used {format_bytes(used)} of its {format_bytes(quota)} storage quota; "
        f"{what} does not fit in the rest. Nothing was stored: delete old uploads or ask support for more.",
        code="storage_quota_exceeded",
    )


def register_adapter(
    project: Project, archive: Path, *, base_model: str, name: str = "", model_id: str | None = None
) -> tuple[Model, Revision]:
    """Check and unpack a PEFT adapter archive, then register it as a new adapter or a new revision."""
    base_model = check_length("base_model", base_model.strip(), Model.BASE_MODEL_MAX)
    name = check_length("name", name.strip(), Model.NAME_MAX)
    if not base_model:
        raise InvalidInput("base_model is required: the adapter base ID the adapter was trained on")
    model = None
    if model_id:
        model = get_model(project, model_id)
        if model.kind != Model.Kind.ADAPTER or model.project_id != project.id:
            raise InvalidInput(f"model {model_id} is not an adapter", code="not_an_adapter")
        if model.base_model != base_model:
            raise InvalidInput(
                f"model {model_id} records base {model.base_model}; a new revision must be trained on the same base, not {base_model}"
            )
    supported = SupportedBase.for_base_id(base_model)
    max_bytes, quota_left = settings.ADAPTER_MAX_BYTES, storage_left(project)
    with archives.unpacking(settings.ARTIFACT_ROOT / "incoming") as unpacked:
        try:
            adapter_dir = archives.extract(
                archive, unpacked, max_bytes=min(max_bytes, quota_left), max_files=settings.ADAPTER_MAX_FILES,
                base_shapes=supported.weight_shapes if supported else None,
                max_pattern_steps=settings.ADAPTER_PATTERN_MAX_STEPS,
            )
        except TooLarge:
            if quota_left < max_bytes:
                raise quota_exceeded(project, "this adapter") from None
            raise
        archives.flatten(adapter_dir, unpacked)
        listing = manifest(unpacked)
        with transaction.atomic():  # a new adapter exists only with its first revision
            claim_storage(project, listing[1], "this adapter")
            if model is None:
                model = Model.objects.create(
                    project=project,
                    kind=Model.Kind.ADAPTER,
                    name=name or f"adapter on {base_model}"[: Model.NAME_MAX],
                    base_model=base_model,
                    supported_base=supported,
                )
            revision = store_revision(model, unpacked, metadata={"source": "upload"}, listing=listing)
    return model, revision
