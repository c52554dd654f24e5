"""The scheduler: pending jobs to free worker slots, and what no worker will settle.

``dispatch`` runs after every create, cancellation and end (the ``slot_freed`` signal) and with
every worker's heartbeat. It ends jobs whose worker died, settles cancellations no worker picked
up, sends again a queued job whose task was lost, prunes work directories, then queues pending
jobs oldest first, as many as each worker kind has free slots.
"""

from __future__ import annotations

import functools
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from registry.models import SupportedBase

from . import lifecycle
from .lifecycle import STATUS_EVENT, after_commit, work_dir
from .models import Job, Worker
from .tasks import enqueue

logger = logging.getLogger(__name__)


def dispatch() -> list[str]:
    """Settle what no worker will, then hand pending jobs to free worker slots, oldest first.
    Returns the IDs of the jobs it queued."""
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


def on_slot_freed(sender: Any, **kwargs: Any) -> None:
    dispatch()


def settle_unclaimed_cancellations() -> None:
    for job in Job.objects.filter(status=Job.Status.CANCEL_REQUESTED, started_at__isnull=True):
        lifecycle.cancel(job, "Job cancelled before a worker started it", condition=Q(started_at__isnull=True))


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
            ended = lifecycle.cancel(
                job, f"Job cancelled; its worker {job.worker} stopped (last heartbeat {last})", condition=condition
            )
        else:
            ended = lifecycle.fail(
                job,
                Job.Status.ERROR,
                f"The worker running this job ({job.worker}) stopped sending heartbeats (last at {last}) "
                f"during {job.stage or 'start-up'}; nothing was registered. Retrying may help: a requeue "
                "continues from the last layer it finished.",
                data={"worker": job.worker, "stage": job.stage},
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
