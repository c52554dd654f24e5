"""What users do with jobs: estimate, create, cancel, and support's requeue. The API, the pages and
the admin call these.

A job's life: pending -> queued (the scheduler, when a worker slot of the job's kind is free) ->
running (the worker's claim) -> completed | error | user_error; cancel_requested -> cancelled.
Every status and stage change writes an event; every end (``lifecycle``) settles the credit hold
in the same transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import transaction

from fp4prep.site.errors import Conflict, Forbidden, InvalidInput, PaymentRequired, check_length
from fp4prep.text import excerpt
from registry.models import (
    CreditTransaction,
    Model,
    Project,
    Revision,
    SupportedBase,
    get_model,
    get_revision,
)

from .lifecycle import STATUS_EVENT, after_commit, work_dir
from .models import CalibrationFile, Job, get_file, get_job
from .scheduler import dispatch

logger = logging.getLogger(__name__)



@dataclass
class Inputs:
    adapter: Model
    revision: Revision
    calibration_file: CalibrationFile | None
    supported_base: SupportedBase


@dataclass
class Estimate:
    inputs: Inputs
    price_usd: Decimal
    time_hours: Decimal
    allowed_to_proceed: bool
    reason: str
    balance_usd: Decimal
    held_usd: Decimal
    available_usd: Decimal

    def to_dict(self) -> dict[str, Any]:
        base = self.inputs.supported_base
        return {
            "price_usd": float(self.price_usd),
            "time_hours": float(self.time_hours),
            "allowed_to_proceed": self.allowed_to_proceed,
            "reason": self.reason,
            "balance_usd": float(self.balance_usd),
            "held_usd": float(self.held_usd),
            "available_usd": float(self.available_usd),
            "base_model": base.family,
            "quantization": base.quantization,
            "adapter_object_id": self.inputs.adapter.id,
            "adapter_revision_id": self.inputs.revision.id,
            "calibration_file_id": self.inputs.calibration_file.id if self.inputs.calibration_file else None,
        }


def _string(inputs: dict[str, Any], key: str, required: bool = False) -> str | None:
    value = inputs.get(key)
    if value is None or value == "":
        if required:
            raise InvalidInput(f"inputs.{key} is required")
        return None
    if not isinstance(value, str):
        raise InvalidInput(f"inputs.{key} must be a string")
    if not value.isprintable():  # control characters, lone surrogates: no ID holds one
        raise InvalidInput(f"inputs.{key}: {excerpt(value)} holds a character no ID has")
    return check_length(f"inputs.{key}", value, 64)


def resolve_inputs(project: Project, inputs: dict[str, Any]) -> Inputs:
    """Everything estimate and create both check, in the order a user can fix it."""
    if not isinstance(inputs, dict):
        raise InvalidInput("inputs must be an object with adapter_object_id")
    adapter_id = _string(inputs, "adapter_object_id", required=True)
    assert adapter_id is not None
    adapter = get_model(project, adapter_id)
    if adapter.kind in (Model.Kind.BASE, Model.Kind.MERGED, Model.Kind.PREPARED):
        raise InvalidInput(f"model {adapter.id} is not an adapter", code="not_an_adapter")
    if not adapter.records_fine_tuning:
        raise InvalidInput(f"model {adapter.id} does not record a fine-tuning relation", code="no_fine_tuning_relation")
    supported = SupportedBase.for_base_id(adapter.base_model)
    if supported is None:
        raise InvalidInput(
            f"Preparing an adapter on base model {adapter.base_model} is not supported", code="unsupported_base"
        )
    revision_id = _string(inputs, "adapter_revision_id")
    revision = get_revision(adapter, revision_id) if revision_id else adapter.latest_revision()
    if revision is None:
        raise InvalidInput(f"model {adapter.id} has no revisions to prepare", code="no_revision")
    calibration = None
    file_id = _string(inputs, "calibration_file_id")
    if file_id:
        calibration = get_file(project, file_id)
        if calibration.status != CalibrationFile.Status.PROCESSED:
            raise InvalidInput(f"Calibration file {file_id} did not pass validation", code="file_invalid")
    return Inputs(adapter, revision, calibration, supported)


def _credit_problem(project: Project, price: Decimal) -> tuple[str, Any]:
    credit = project.credit()
    if credit.available < price:
        return (
            f"The estimated price ${price} exceeds the project's available credit ${credit.available} "
            f"(balance ${credit.balance}, ${credit.held} held by other jobs). Add credits and retry.",
            credit,
        )
    return "", credit


def blocked_message(project: Project) -> str:
    reason = f" ({project.blocked_reason})" if project.blocked_reason else ""
    return f"Project {project.id} is blocked from starting jobs{reason}. Contact support."


def estimate(project: Project, inputs: dict[str, Any]) -> Estimate:
    """Price and time from the catalogue; never charges and never holds."""
    resolved = resolve_inputs(project, inputs)
    base = resolved.supported_base
    price = base.price()
    problem, credit = _credit_problem(project, price)
    if project.blocked:
        problem = blocked_message(project)
    return Estimate(
        inputs=resolved,
        price_usd=price,
        time_hours=base.typical_hours,
        allowed_to_proceed=not problem,
        reason=problem,
        balance_usd=credit.balance,
        held_usd=credit.held,
        available_usd=credit.available,
    )


IDEMPOTENCY_KEY_MAX = 255


def _fingerprint(inputs: Any) -> str:
    """What makes two creates the same request: the inputs as given, canonically."""
    fields = inputs if isinstance(inputs, dict) else {}
    canonical = {k: fields.get(k) or None for k in ("adapter_object_id", "adapter_revision_id", "calibration_file_id")}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def check_idempotency_key(key: str) -> str:
    if not (0 < len(key) <= IDEMPOTENCY_KEY_MAX) or not key.isprintable() or not key.isascii():
        raise InvalidInput(f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX} printable ASCII characters", code="invalid_idempotency_key")
    return key


def create_job(project: Project, inputs: dict[str, Any], *, idempotency_key: str = "") -> Job:
    """Re-check everything, hold the price and create the job in one transaction.

    The project row is locked first, so two creates for one project run one after the other and
    the second sees the first's hold: they can't both spend the same credit. With an
    ``idempotency_key``, a create the project already made with that key returns that job (its
    ``replayed`` set) and holds nothing more; the same key with other inputs is a conflict.
    """
    with transaction.atomic():
        locked = Project.objects.select_for_update().get(pk=project.pk)
        fingerprint = _fingerprint(inputs)
        if idempotency_key:
            earlier = Job.objects.filter(project=locked, idempotency_key=check_idempotency_key(idempotency_key)).first()
            if earlier is not None:
                if earlier.request_fingerprint != fingerprint:
                    raise Conflict(
                        f"Idempotency-Key {excerpt(idempotency_key)} was already used by job {earlier.id} with other inputs; "
                        "use a new key for a new job",
                        code="idempotency_key_reused",
                    )
                earlier.replayed = True
                return earlier
        resolved = resolve_inputs(locked, inputs)
        if locked.blocked:
            raise Forbidden(blocked_message(locked))
        base = resolved.supported_base
        price = base.price()
        problem, _ = _credit_problem(locked, price)
        if problem:
            raise PaymentRequired(problem)
        job = Job.objects.create(
            project=locked,
            adapter=resolved.adapter,
            adapter_revision=resolved.revision,
            calibration_file=resolved.calibration_file,
            supported_base=base,
            price_usd=price,
            time_hours=base.typical_hours,
            estimate={"price_usd": float(price), "time_hours": float(base.typical_hours)},
            idempotency_key=idempotency_key,
            request_fingerprint=fingerprint,
        )
        CreditTransaction.objects.create(
            project=locked, kind=CreditTransaction.Kind.HOLD, amount=price, job_id=job.id, note="held for the job"
        )
        job.event(
            STATUS_EVENT,
            f"Job created; waiting for a {base.worker_kind.upper()} worker slot. ${price} of credit is held.",
            data={"status": Job.Status.PENDING},
        )
        after_commit(dispatch)
    return job


def request_cancel(project: Project, job_id: str) -> Job:
    job = get_job(project, job_id)
    with transaction.atomic():
        changed = Job.objects.filter(pk=job.pk, status__in=Job.CANCELLABLE).update(status=Job.Status.CANCEL_REQUESTED)
        job.refresh_from_db()
        if not changed:
            if job.status == Job.Status.CANCEL_REQUESTED:
                why = "its cancellation was already requested; it stops at the worker's next check"
            else:
                why = f"it has already ended ({job.status})"
            raise Conflict(f"Shaping job {job.id} is not cancellable: {why}", code="job_not_cancellable")
        job.event(
            STATUS_EVENT,
            "Cancellation requested; the job stops at its next check",
            data={"status": Job.Status.CANCEL_REQUESTED},
        )
        after_commit(dispatch)  # settles a job no worker has picked up yet
    return job


REQUEUEABLE = (Job.Status.ERROR, Job.Status.CANCELLED)


def requeue(job: Job) -> Job:
    """Support's action: run a failed or cancelled job's inputs again as a new job (new hold, new ID).

    What the failed job finished (its calibrated layers, its export) moves to the new job, which
    continues from there. A job is requeued once: its row is locked while the new job is made, so a
    second requeue (from another admin session at the same time, or later) is refused naming the
    job the first made, and never holds credit a second time.
    """
    with transaction.atomic():
        # The project first, as a create locks it: two requeues wait on each other, never deadlock.
        Project.objects.select_for_update().get(pk=job.project_id)
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.requeued_as_id:
            raise Conflict(
                f"Job {job.id} was already requeued as {locked.requeued_as_id}; requeue that job if it fails too",
                code="already_requeued",
            )
        if locked.status not in REQUEUEABLE:
            why = {
                Job.Status.COMPLETED: "its model is registered, and a requeue would hold and charge for that work again",
                Job.Status.USER_ERROR: "it stopped on its inputs, which would fail the same way: the customer fixes them and creates a new job",
            }.get(locked.status, "it has not ended")
            raise Conflict(
                f"Job {job.id} is {locked.status}; only jobs that ended in error or were cancelled can be requeued: {why}",
                code="not_requeueable",
            )
        inputs = {
            "adapter_object_id": locked.adapter_id,
            "adapter_revision_id": locked.adapter_revision_id,
            "calibration_file_id": locked.calibration_file_id,
        }
        new = create_job(locked.project, inputs)
        locked.requeued_as = new
        locked.save(update_fields=["requeued_as"])
        kept = work_dir(job.id)
        resumes = kept.is_dir() and locked.status == Job.Status.ERROR
        if resumes:
            kept.rename(work_dir(new.id))
        new.event(
            STATUS_EVENT,
            f"Requeued from {job.id} by support" + ("; it continues from where that job stopped" if resumes else ""),
            data={"status": new.status, "requeued_from": job.id},
        )
    return new
