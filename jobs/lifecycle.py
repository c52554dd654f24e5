"""How a job ends, in one place: ``complete``, ``fail`` and ``cancel``.

Every end is a conditional update (a job ends once, whoever gets there first), writes its event and
settles the job's credit hold in the same transaction: a charge when it completed, a release
otherwise. Once that commits, ``slot_freed`` fires; the scheduler listens and dispatches the next
pending job (a signal, so that the endings need not import the scheduler that calls them).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from registry.models import CreditTransaction, Model, Revision

from .models import Job

STATUS_EVENT = "JOB_STATUS"
STAGE_EVENT = "JOB_STAGE"
USER_ERROR_EVENT = "SHAPING_USER_ERROR"
ERROR_EVENT = "SHAPING_ERROR"

# Sent after a job ended or a cancellation was asked for: a worker slot may be free.
slot_freed = Signal()


def after_commit(func: Callable[[], Any]) -> None:
    """Run ``func`` once the transaction commits; if it fails, log it: what committed stays done
    and the answer to the request that did it is not an error (the scheduler retries dispatch)."""
    transaction.on_commit(func, robust=True)


def wake_scheduler() -> None:
    """Ask for a dispatch once the current transaction (if any) commits."""
    after_commit(lambda: slot_freed.send(sender=Job))


def _end(
    job: Job,
    status: str,
    *,
    message: str,
    event_type: str,
    level: str,
    data: dict[str, Any] | None,
    from_statuses: tuple[str, ...],
    condition: Q | None = None,
    fields: dict[str, Any] | None = None,
) -> bool:
    """End the job as ``status`` if it is still in ``from_statuses``; settle its hold. Returns
    whether it ended here."""
    assert status in Job.TERMINAL
    with transaction.atomic():
        query = Job.objects.filter(pk=job.pk, status__in=from_statuses)
        if condition is not None:
            query = query.filter(condition)
        if query.update(status=status, finished_at=timezone.now(), **(fields or {})) != 1:
            return False
        kind = CreditTransaction.Kind.CHARGE if status == Job.Status.COMPLETED else CreditTransaction.Kind.RELEASE
        CreditTransaction.objects.create(
            project_id=job.project_id, kind=kind, amount=job.price_usd, job_id=job.id, note=f"job {status}"
        )
        job.event(event_type, message, level=level, data={"status": status, **(data or {})})
        wake_scheduler()
    job.refresh_from_db()
    return True


def complete(job: Job, model: Model, revision: Revision, report: dict[str, Any]) -> bool:
    """A running job's checkpoint is registered as ``revision``: charge the hold."""
    return _end(
        job, Job.Status.COMPLETED,
        message=f"Job completed: model {model.id}, revision {revision.id}",
        event_type=STATUS_EVENT, level="info",
        data={"api_model_object_id": model.id, "api_model_revision_id": revision.id},
        from_statuses=(Job.Status.RUNNING,),
        fields={"progress": 1.0, "result_model": model, "result_revision": revision, "report": report},
    )


def fail(job: Job, status: str, message: str, *, data: dict[str, Any] | None = None, condition: Q | None = None) -> bool:
    """A running job failed: ``user_error`` (its input) or ``error`` (ours). Releases the hold."""
    event_type = USER_ERROR_EVENT if status == Job.Status.USER_ERROR else ERROR_EVENT
    return _end(job, status, message=message, event_type=event_type, level="error", data=data,
                from_statuses=(Job.Status.RUNNING,), condition=condition)


def cancel(job: Job, message: str, *, data: dict[str, Any] | None = None, condition: Q | None = None,
           running: bool = False) -> bool:
    """A job whose cancellation was asked for stops: cancelled, the hold released. With ``running``
    a running job ends cancelled too (its run stopped because it was cancelled)."""
    from_statuses = (Job.Status.RUNNING, Job.Status.CANCEL_REQUESTED) if running else (Job.Status.CANCEL_REQUESTED,)
    return _end(job, Job.Status.CANCELLED, message=message, event_type=STATUS_EVENT, level="info", data=data,
                from_statuses=from_statuses, condition=condition)


def fail_or_cancel(job: Job, status: str, message: str, *, data: dict[str, Any] | None = None) -> None:
    """End a run that stopped: as ``status``, or cancelled if cancellation was asked for meanwhile
    (the run stopped, so the cancellation is what happened)."""
    if status == Job.Status.CANCELLED:
        cancel(job, message, data=data, running=True)
    elif not fail(job, status, message, data=data):
        cancel(job, "Job cancelled", data=data)


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
