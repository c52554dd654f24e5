"""Calibration files, preparation jobs with their events, and the workers that run them."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from fp4prep import statuses
from fp4prep.site import ids
from fp4prep.site.errors import NotFound
from fp4prep.text import clip
from registry.models import Model, Project, Revision, SupportedBase


class CalibrationFile(models.Model):
    class Status(models.TextChoices):
        PROCESSED = "processed"
        ERROR = "error"

    id = models.CharField(primary_key=True, max_length=40, default=ids.file_id, editable=False)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=20, default="calibration")
    filename = models.CharField(max_length=255)
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    status = models.CharField(max_length=10, choices=Status.choices)
    # {"conversations", "error_count", "errors": [{"line", "message"}, ...]}
    report = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["project", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.filename} ({self.id})"

    @property
    def path(self) -> Path:
        return settings.ARTIFACT_ROOT / "files" / f"{self.id}.jsonl"


def get_file(project: Project, file_id: str) -> CalibrationFile:
    found = CalibrationFile.objects.filter(project=project, pk=file_id).first()
    if found is None:
        raise NotFound(f"Calibration file {clip(file_id, 60)} not found", code="file_not_found")
    return found


# What each of a run's stages does, in their order: the pipeline's, then registration.
STAGE_MESSAGES = {
    "merging": "Merging the adapter into the base's BF16 weights",
    "calibrating": "Calibrating on the corpus (half your conversations, half general text)",
    "quantizing": "Quantizing",
    "exporting": "Exporting the checkpoint",
    "validating": "Validating: structure, independent reload, token parity with the BF16 merged model",
    "uploading": "Registering the checkpoint as a new model revision",
}


class Job(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        QUEUED = "queued"
        RUNNING = "running"
        CANCEL_REQUESTED = "cancel_requested"
        CANCELLED = "cancelled"
        COMPLETED = "completed"
        ERROR = "error"
        USER_ERROR = "user_error"

    TERMINAL = tuple(s for s in Status.values if s in statuses.TERMINAL)
    CANCELLABLE = tuple(s for s in Status.values if s in statuses.CANCELLABLE)
    # Holding a worker slot: handed to the queue and not yet finished.
    ACTIVE = (Status.QUEUED, Status.RUNNING, Status.CANCEL_REQUESTED)

    id = models.CharField(primary_key=True, max_length=40, default=ids.job_id, editable=False)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="jobs")
    adapter = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="jobs")
    adapter_revision = models.ForeignKey(Revision, on_delete=models.PROTECT, related_name="+")
    calibration_file = models.ForeignKey(
        CalibrationFile, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs"
    )
    supported_base = models.ForeignKey(SupportedBase, on_delete=models.PROTECT, related_name="jobs")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING, db_index=True)
    stage = models.CharField(max_length=20, blank=True)
    progress = models.FloatField(default=0.0)  # of the current stage, 0..1
    stage_started_at = models.DateTimeField(null=True, blank=True)
    price_usd = models.DecimalField(max_digits=14, decimal_places=2)
    time_hours = models.DecimalField(max_digits=8, decimal_places=3)
    estimate = models.JSONField(default=dict)
    result_model = models.ForeignKey(Model, null=True, blank=True, on_delete=models.SET_NULL, related_name="produced_by")
    result_revision = models.ForeignKey(Revision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    report = models.JSONField(default=dict, blank=True)  # the pipeline's result: parity, retention, sizes
    worker = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # A retried create with the same Idempotency-Key gets this job back instead of a second one.
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True)
    # The job support's requeue made of this one: a failed job is requeued once.
    requeued_as = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="requeued_from"
    )

    # Set (not stored) on the job a create returns when it was made by an earlier request.
    replayed = False

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["project", "-created_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "idempotency_key"], condition=~models.Q(idempotency_key=""), name="job_idempotency_key_unique"
            )
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL

    def eta_seconds(self) -> float | None:
        """Time left in the current stage, from its progress so far; None when there is nothing to go on."""
        if self.status != self.Status.RUNNING or not self.stage_started_at or self.progress <= 0.02:
            return None
        elapsed = (timezone.now() - self.stage_started_at).total_seconds()
        return max(elapsed / self.progress - elapsed, 0.0)

    def event(self, type: str, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> JobEvent:
        return JobEvent.objects.create(job=self, type=type, level=level, message=message, data=data)


def get_job(project: Project, job_id: str, among: models.QuerySet[Job] | None = None) -> Job:
    """The project's job; ``among`` (e.g. with select_related) is where to look, all jobs by default."""
    found = (Job.objects.all() if among is None else among).filter(project=project, pk=job_id).first()
    if found is None:
        raise NotFound(f"Shaping job {clip(job_id, 60)} not found", code="job_not_found")
    return found


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(default=timezone.now)
    type = models.CharField(max_length=40)
    level = models.CharField(max_length=10, default="info")
    message = models.TextField()
    data = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.type}: {self.message[:60]}"


class Worker(models.Model):
    """A worker cluster (``manage.py runworker``) that announced itself; alive while its heartbeat is fresh."""

    name = models.CharField(primary_key=True, max_length=200)
    kind = models.CharField(max_length=3, choices=SupportedBase.WorkerKind.choices)
    slots = models.PositiveIntegerField()
    started_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["kind", "name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}, {self.slots} slots)"

    @classmethod
    def alive(cls) -> models.QuerySet[Worker]:
        return cls.objects.filter(last_seen__gte=timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT))
