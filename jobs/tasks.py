"""The queue's entry points: ``enqueue`` puts a job on its worker kind's queue, and django-q2 runs
``prepare`` for it in a worker process."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction

from . import worker
from .lifecycle import STATUS_EVENT
from .models import Job

logger = logging.getLogger(__name__)


def prepare(job_id: str) -> str:
    """Run the job on this worker; returns how it ended (``completed``, ``error``, …, ``not claimed``)."""
    return worker.run(job_id)


def enqueue(job: Job) -> None:
    """Put a queued job on its kind's queue. If the broker can't take it, the job goes back to
    ``pending`` (nothing is lost, nothing is charged twice) and the next dispatch queues it again:
    every worker's heartbeat dispatches, so that is seconds after the broker is back."""
    from django_q.tasks import async_task

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
