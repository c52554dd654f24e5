"""The verbs of the job lifecycle (SPEC section 2). The API, the pages, the admin and the workers call
these; none of them changes a job's status any other way.

pending -> queued (dispatch, when a worker slot of the job's kind is free) -> running (the task's
claim) -> completed | error | user_error; cancel_requested -> cancelled. Every status and stage change
writes an event; every end settles the credit hold in the same transaction.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from fp4prep.errors import Conflict, Forbidden, InvalidInput, PaymentRequired
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

from .models import CalibrationFile, Job, Worker, get_file, get_job

logger = logging.getLogger(__name__)

STATUS_EVENT = "JOB_STATUS"
STAGE_EVENT = "JOB_STAGE"
USER_ERROR_EVENT = "SHAPING_USER_ERROR"
ERROR_EVENT = "SHAPING_ERROR"


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
    return value


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


def after_commit(func: Callable[[], Any]) -> None:
    """Run ``func`` once the transaction commits; if it fails, log it: what committed stays done
    and the answer to the request that did it is not an error (the scheduler retries dispatch)."""
    transaction.on_commit(func, robust=True)


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


def requeue(job: Job) -> Job:
    """Support's action: run a failed or cancelled job's inputs again as a new job (new hold, new ID).

    What the failed job finished (its calibrated layers, its export) moves to the new job, which
    continues from there.
    """
    inputs = {
        "adapter_object_id": job.adapter_id,
        "adapter_revision_id": job.adapter_revision_id,
        "calibration_file_id": job.calibration_file_id,
    }
    new = create_job(job.project, inputs)
    kept = work_dir(job.id)
    resumes = kept.is_dir() and job.status == Job.Status.ERROR
    if resumes:
        kept.rename(work_dir(new.id))
    new.event(
        STATUS_EVENT,
        f"Requeued from {job.id} by support" + ("; it continues from where that job stopped" if resumes else ""),
        data={"status": new.status, "requeued_from": job.id},
    )
    return new


def finish(
    job: Job,
    status: str,
    *,
    message: str,
    event_type: str = STATUS_EVENT,
    level: str = "info",
    data: dict[str, Any] | None = None,
    from_statuses: tuple[str, ...] = (Job.Status.RUNNING, Job.Status.CANCEL_REQUESTED),
    condition: Q | None = None,
    result: tuple[Model, Revision] | None = None,
    report: dict[str, Any] | None = None,
) -> bool:
    """End the job if it is still in ``from_statuses``; settle its hold. Returns whether it ended here."""
    assert status in Job.TERMINAL
    with transaction.atomic():
        query = Job.objects.filter(pk=job.pk, status__in=from_statuses)
        if condition is not None:
            query = query.filter(condition)
        fields: dict[str, Any] = {"status": status, "finished_at": timezone.now()}
        if status == Job.Status.COMPLETED:
            fields["progress"] = 1.0
        if result is not None:
            fields["result_model"], fields["result_revision"] = result
        if report is not None:
            fields["report"] = report
        if query.update(**fields) != 1:
            return False
        kind = CreditTransaction.Kind.CHARGE if status == Job.Status.COMPLETED else CreditTransaction.Kind.RELEASE
        CreditTransaction.objects.create(
            project_id=job.project_id, kind=kind, amount=job.price_usd, job_id=job.id, note=f"job {status}"
        )
        job.event(event_type, message, level=level, data={"status": status, **(data or {})})
        after_commit(dispatch)  # a slot is free
    job.refresh_from_db()
    return True


def work_dir(job_id: str) -> Path:
    """Where a job's pipeline writes until its checkpoint is registered.

    Removed when the job ends, except after an error: then what the run finished stays for
    ``RESUME_KEEP_HOURS``, so that a requeue continues from there.
    """
    return Path(settings.ARTIFACT_ROOT) / "work" / job_id


def drop_work_dir(job: Job) -> None:
    """Remove the job's work directory unless the job ended in an error a requeue could resume."""
    status = Job.objects.filter(pk=job.pk).values_list("status", flat=True).first()
    if status != Job.Status.ERROR:
        shutil.rmtree(work_dir(job.id), ignore_errors=True)


def prune_work_dirs() -> None:
    """Remove work directories no job will use: ended jobs', and failed jobs' once kept long enough."""
    root = Path(settings.ARTIFACT_ROOT) / "work"
    if not root.is_dir():
        return
    names = [p.name for p in root.iterdir()]
    if not names:
        return
    cutoff = timezone.now() - timedelta(hours=settings.RESUME_KEEP_HOURS)
    ended = dict(Job.objects.filter(pk__in=names).values_list("pk", "status"))
    for name in names:
        status = ended.get(name)
        if status is None or status not in Job.TERMINAL:
            continue  # still running (or not a job's): its worker owns it
        if status == Job.Status.ERROR and Job.objects.filter(pk=name, finished_at__gte=cutoff).exists():
            continue
        shutil.rmtree(root / name, ignore_errors=True)


def dispatch() -> list[str]:
    """Settle what no worker will, then hand pending jobs to free worker slots, oldest first.

    Called after every create, cancel and end, and by every worker's heartbeat. Returns the IDs
    of the jobs it queued.
    """
    reap_dead_jobs()
    settle_unclaimed_cancellations()
    resend_stale_queued()
    prune_work_dirs()
    queued: list[str] = []
    for kind in SupportedBase.WorkerKind.values:
        with transaction.atomic():
            # Locking the kind's live workers serializes dispatchers, so slots are never oversold.
            capacity = sum(w.slots for w in Worker.alive().filter(kind=kind).select_for_update())
            active = Job.objects.filter(status__in=Job.ACTIVE, supported_base__worker_kind=kind).count()
            free = capacity - active
            if free <= 0:
                continue
            pending = Job.objects.filter(status=Job.Status.PENDING, supported_base__worker_kind=kind)
            for job in pending.order_by("created_at")[:free]:
                now = timezone.now()
                if Job.objects.filter(pk=job.pk, status=Job.Status.PENDING).update(status=Job.Status.QUEUED, queued_at=now):
                    job.event(
                        STATUS_EVENT, f"Job is queued: a {kind.upper()} worker slot is free", data={"status": Job.Status.QUEUED}
                    )
                    after_commit(functools.partial(enqueue, job))
                    queued.append(job.id)
    return queued


def enqueue(job: Job) -> None:
    """Put a queued job on its kind's queue. If the broker can't take it, the job goes back to
    ``pending`` (nothing is lost, nothing is charged twice) and the next dispatch queues it again:
    every worker's heartbeat dispatches, so that is seconds after the broker is back."""
    from django_q.tasks import async_task

    from .tasks import prepare

    try:
        async_task(
            prepare,
            job.id,
            cluster=f"{settings.QUEUE_PREFIX}-{job.supported_base.worker_kind}",
            task_name=f"prepare {job.id}",
            group="prepare",
        )
    except Exception as exc:
        logger.warning("job %s: the job queue can't be reached (%s); back to pending", job.id, exc)
        with transaction.atomic():
            if Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(status=Job.Status.PENDING, queued_at=None):
                job.event(
                    STATUS_EVENT,
                    "The job queue could not be reached; the job waits as pending and is queued again once it is back",
                    level="warning",
                    data={"status": Job.Status.PENDING},
                )


def settle_unclaimed_cancellations() -> None:
    for job in Job.objects.filter(status=Job.Status.CANCEL_REQUESTED, started_at__isnull=True):
        finish(
            job,
            Job.Status.CANCELLED,
            message="Job cancelled before a worker started it",
            from_statuses=(Job.Status.CANCEL_REQUESTED,),
            condition=Q(started_at__isnull=True),
        )


def reap_dead_jobs() -> None:
    """A running job whose worker stopped sending heartbeats ends: error (or cancelled if asked)."""
    cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT)
    stale = Job.objects.filter(
        status__in=(Job.Status.RUNNING, Job.Status.CANCEL_REQUESTED), started_at__isnull=False, heartbeat_at__lt=cutoff
    )
    for job in stale:
        last = job.heartbeat_at.strftime("%Y-%m-%d %H:%M:%S UTC") if job.heartbeat_at else "never"
        condition = Q(heartbeat_at__lt=cutoff)
        if job.status == Job.Status.CANCEL_REQUESTED:
            ended = finish(
                job, Job.Status.CANCELLED, message=f"Job cancelled; its worker {job.worker} stopped (last heartbeat {last})",
                from_statuses=(Job.Status.CANCEL_REQUESTED,), condition=condition,
            )
        else:
            ended = finish(
                job,
                Job.Status.ERROR,
                event_type=ERROR_EVENT,
                level="error",
                message=(
                    f"The worker running this job ({job.worker}) stopped sending heartbeats (last at {last}) "
                    f"during {job.stage or 'start-up'}; nothing was registered. Retrying may help: a requeue "
                    "continues from the last layer it finished."
                ),
                data={"worker": job.worker, "stage": job.stage},
                from_statuses=(Job.Status.RUNNING,),
                condition=condition,
            )
        if ended:
            logger.warning("job %s: worker %s stopped sending heartbeats", job.id, job.worker)
            if job.status == Job.Status.CANCEL_REQUESTED:
                shutil.rmtree(work_dir(job.id), ignore_errors=True)


def resend_stale_queued() -> None:
    """A queued job whose task was lost (a broker that forgets, a worker that died before claiming)
    is sent again; the claim makes a second delivery harmless."""
    wait = max(settings.HEARTBEAT_TIMEOUT, 60)
    cutoff = timezone.now() - timedelta(seconds=wait)
    for job in Job.objects.filter(status=Job.Status.QUEUED, queued_at__lt=cutoff).select_related("supported_base"):
        if Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED, queued_at__lt=cutoff).update(queued_at=timezone.now()):
            logger.warning("job %s: queued for over %.0fs without a worker claiming it; sent again", job.id, wait)
            after_commit(functools.partial(enqueue, job))
