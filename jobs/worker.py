"""A job's run on a worker: the claim, the heartbeat, progress and cancellation, the pipeline,
and registration of its checkpoint.

torch, transformers and ModelOpt are imported inside the run, never by the web process.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from django.conf import settings
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.utils import timezone

from fp4prep.text import without_paths
from registry.artifacts import manifest, store_revision
from registry.models import Model, SupportedBase

from . import lifecycle
from .lifecycle import STAGE_EVENT, STATUS_EVENT
from .models import STAGE_MESSAGES, Job

if TYPE_CHECKING:
    from fp4prep.pipeline import PipelineResult

logger = logging.getLogger(__name__)

PROGRESS_WRITE_SECONDS = 1.0
CANCEL_CHECK_SECONDS = 0.5
# How long the worker's writes wait out a database that went away (a restart, a failover).
DB_RETRY_SECONDS = 120.0
T = TypeVar("T")


def with_database(what: str, call: Callable[[], T]) -> T:
    """``call()``, retried on a lost database connection until ``DB_RETRY_SECONDS`` have passed: a
    database restart mid-job pauses the job's writes instead of failing a run of hours."""
    deadline = time.monotonic() + DB_RETRY_SECONDS
    delay = 0.5
    while True:
        try:
            return call()
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() + delay > deadline or connection.in_atomic_block:
                raise
            logger.warning("%s: the database is unreachable (%s); retrying in %.1fs", what, str(exc).strip()[:200], delay)
            connection.close()  # the next try opens a fresh connection
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def worker_name() -> str:
    cluster = os.environ.get("FP4PREP_WORKER_NAME") or settings.WORKER_NAME or socket.gethostname()
    return f"{cluster}/{os.getpid()}"


def run(job_id: str) -> str:
    """Claim the job (a task delivered twice runs once), run the pipeline, register the result.
    Returns how the job ended, or ``not claimed``."""
    close_old_connections()
    now = timezone.now()
    name = worker_name()
    claimed = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.RUNNING, started_at=now, heartbeat_at=now, worker=name
    )
    if not claimed:
        lifecycle.wake_scheduler()  # a cancellation that came first is settled there
        return "not claimed"
    job = Job.objects.select_related(
        "supported_base", "adapter", "adapter_revision", "calibration_file", "project"
    ).get(pk=job_id)
    job.event(STATUS_EVENT, f"Job is running on worker {name}", data={"status": Job.Status.RUNNING, "worker": name})
    heartbeat = Heartbeat(job.id, name)
    heartbeat.start()
    try:
        return _run(job)
    finally:
        heartbeat.stop()
        lifecycle.drop_work_dir(job)


class Heartbeat(threading.Thread):
    """Tells the dispatcher this job's worker is alive, even inside one long library call."""

    def __init__(self, job_id: str, worker: str) -> None:
        super().__init__(daemon=True, name=f"heartbeat {job_id}")
        self.job_id, self.worker = job_id, worker
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(settings.HEARTBEAT_INTERVAL):
                try:
                    Job.objects.filter(pk=self.job_id, worker=self.worker).update(heartbeat_at=timezone.now())
                except DatabaseError as exc:
                    # One failed beat must not end the heartbeat: the job would be reaped while it runs.
                    logger.warning("job %s: heartbeat not written (%s); trying again", self.job_id, str(exc).strip()[:200])
                    connection.close()
        finally:
            connection.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


class Reporter:
    """The pipeline's progress callback and cancellation check, wired to the job row."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.stage = ""
        self.last_write = 0.0
        self.last_check = 0.0
        self.cancelled = False

    def progress(self, stage: str, fraction: float) -> None:
        now = time.monotonic()
        if stage != self.stage:
            self.stage = stage
            self.last_write = now

            def begin() -> None:
                with transaction.atomic():
                    Job.objects.filter(pk=self.job.pk).update(
                        stage=stage, progress=fraction, stage_started_at=timezone.now(), heartbeat_at=timezone.now()
                    )
                    self.job.event(STAGE_EVENT, STAGE_MESSAGES.get(stage, stage), data={"stage": stage})

            with_database(f"job {self.job.id}", begin)
        elif now - self.last_write >= PROGRESS_WRITE_SECONDS or fraction >= 1.0:
            self.last_write = now
            with_database(
                f"job {self.job.id}",
                lambda: Job.objects.filter(pk=self.job.pk).update(progress=fraction, heartbeat_at=timezone.now()),
            )

    def note(self, message: str) -> None:
        with_database(f"job {self.job.id}", lambda: self.job.event(STAGE_EVENT, message, data={"stage": self.stage}))

    def should_cancel(self) -> bool:
        now = time.monotonic()
        if not self.cancelled and now - self.last_check >= CANCEL_CHECK_SECONDS:
            self.last_check = now
            status = with_database(
                f"job {self.job.id}", lambda: Job.objects.filter(pk=self.job.pk).values_list("status", flat=True).first()
            )
            # Anything but running stops the run: a cancellation, or a reaper that gave up on us.
            self.cancelled = status != Job.Status.RUNNING
        return self.cancelled


def _run(job: Job) -> str:
    from fp4prep.pipeline.errors import Cancelled, InternalError, PipelineError, UserError

    reporter = Reporter(job)
    try:
        result = _pipeline(job, reporter)
    except Cancelled:
        _end(job, Job.Status.CANCELLED, f"Job cancelled during {reporter.stage or 'start-up'}", data={"stage": reporter.stage})
        return "cancelled"
    except UserError as exc:
        _end(job, Job.Status.USER_ERROR, public(str(exc)), data={"stage": reporter.stage})
        return "user_error"
    except InternalError:
        logger.exception("job %s failed", job.id)
        _end(job, Job.Status.ERROR, internal_error(job, reporter.stage), data={"stage": reporter.stage})
        return "error"
    except (PipelineError, WeightsMissing) as exc:
        logger.warning("job %s failed: %s", job.id, exc)
        _end(job, Job.Status.ERROR, public(str(exc)), data={"stage": reporter.stage})
        return "error"
    except Exception:
        logger.exception("job %s failed", job.id)
        _end(job, Job.Status.ERROR, internal_error(job, reporter.stage), data={"stage": reporter.stage})
        return "error"
    try:
        return _register(job, reporter, result)
    except Exception:
        logger.exception("job %s: registration failed", job.id)
        _end(job, Job.Status.ERROR, internal_error(job, "uploading"), data={"stage": "uploading"})
        return "error"


def public(message: str) -> str:
    """What a customer reads of a failure: the message, without where the service keeps files."""
    return without_paths(message)


def internal_error(job: Job, stage: str) -> str:
    # The exception itself goes to the worker's log, not to the customer.
    return (
        f"Internal error during {stage or 'start-up'}; nothing was registered and the hold is released. "
        f"Retrying may help; support can look it up under job {job.id}."
    )


def _end(job: Job, status: str, message: str, *, data: dict[str, Any]) -> None:
    """End the run as ``status`` (cancelled, if that was asked meanwhile), through a database that
    may be restarting."""
    with_database(f"job {job.id}", lambda: lifecycle.fail_or_cancel(job, status, message, data=data))


class WeightsMissing(Exception):
    pass


def weights_dir(base: SupportedBase) -> Path:
    """Where this worker keeps a catalogue base's weights: the demo's own for the embedded
    base, else ``weights_location`` under ``FP4PREP_WEIGHTS_ROOT``."""
    if base.weights_location.startswith("embedded:"):
        from fp4prep import demo

        return demo.base_dir()
    path = Path(base.weights_location)
    return path if path.is_absolute() else settings.WEIGHTS_ROOT / path


def _pipeline(job: Job, reporter: Reporter) -> PipelineResult:
    from fp4prep.pipeline import PipelineConfig, run
    from fp4prep.pipeline.errors import UserError
    from fp4prep.pipeline.model.releases import weights_format

    base = job.supported_base
    weights = weights_dir(base)
    if not (weights / "config.json").is_file():
        logger.error("job %s: no weights for %s in %s", job.id, base.family, weights)
        raise WeightsMissing(
            f"This worker has no weights for {base.family} ({base.weights_location}). "
            "An operator must install them under FP4PREP_WEIGHTS_ROOT; retrying on a worker that has them may help."
        )
    try:
        found = weights_format(weights)
    except UserError as exc:  # the operator's weights, not the customer's input
        raise WeightsMissing(f"This worker's weights for {base.family} can't be read: {exc}") from None
    if found != base.weights_format:
        logger.error("job %s: %s's weights in %s are %s, not %s", job.id, base.family, weights, found, base.weights_format)
        raise WeightsMissing(
            f"This worker's weights for {base.family} ({base.weights_location}) are stored as {found}, but its catalogue "
            f"entry says {base.weights_format}. An operator must install the weights the entry names, or correct the entry."
        )
    # Checked when the entry was saved; checked again here, for a row edited around the model.
    fixed = base.check_run_settings()
    work = lifecycle.work_dir(job.id)
    out = work / "output"
    shutil.rmtree(out, ignore_errors=True)  # a checkpoint moved here by a run that died registering it
    out.parent.mkdir(parents=True, exist_ok=True)
    config = PipelineConfig(
        base_dir=weights,
        output_dir=out,
        # What the run finished (calibrated layers, the export) stays here until the job ends for
        # good, so a requeued job continues from there.
        work_dir=work / "state",
        device=settings.WORKER_DEVICE,
        quantization=base.quantization,
        adapter_dir=job.adapter_revision.directory,
        calibration_file=job.calibration_file.path if job.calibration_file else None,
        user_token_minimum=base.user_token_minimum if job.calibration_file else 0,
        # Where the checkpoint will serve: the run measures it as the engine computes it there.
        serving_hardware=sorted({p.hardware for p in base.profiles.all()}),
        lineage={
            "name": f"{job.adapter.name} ({base.quantization.upper()})",
            "base": base.served_base_id,
            "adapter": f"{job.adapter.id}/{job.adapter_revision.id}",
            "adapter_base": job.adapter.base_model,
            "calibration_file": job.calibration_file_id,
            "job": job.id,
            "project": job.project_id,
        },
        progress=reporter.progress,
        should_cancel=reporter.should_cancel,
        notify=reporter.note,
        **fixed.config_fields(),
    )
    return run(config)


def _register(job: Job, reporter: Reporter, result: PipelineResult) -> str:
    reporter.progress("uploading", 0.0)
    return register(job, result.output_dir, _report(result))


def register(job: Job, output: Path, report: dict[str, Any]) -> str:
    """Register ``output`` as the next revision of the project's prepared model and complete the job.

    The checkpoint is hashed first, with no lock held (minutes for a big one); then, with the job's
    row locked, it is moved into the store and the revision, the job's end and its charge are written
    in one transaction. Nothing half-registered: if that transaction fails, the files go too.
    """
    base = job.supported_base
    listing = manifest(output)
    revision = None
    try:
        with transaction.atomic():
            locked = Job.objects.select_for_update().get(pk=job.pk)
            if locked.status != Job.Status.RUNNING:
                lifecycle.cancel(job, "Job cancelled before its checkpoint was registered")
                return "cancelled"
            prepared = Model.objects.filter(
                project=job.project, kind=Model.Kind.PREPARED, source_adapter=job.adapter, supported_base=base
            ).first()
            if prepared is None:  # a repeat job adds a revision to the earlier job's model
                prepared = Model.objects.create(
                    project=job.project,
                    kind=Model.Kind.PREPARED,
                    name=f"{job.adapter.name} ({base.quantization.upper()})",
                    base_model=base.served_base_id,
                    supported_base=base,
                    source_adapter=job.adapter,
                )
            revision = store_revision(
                prepared, output, job_id=job.id, listing=listing,
                metadata={"job": job.id, "quantization": base.quantization,
                          "adapter_revision": job.adapter_revision_id, "report": report},
            )
            lifecycle.complete(job, prepared, revision, report)
    except BaseException:
        # Nothing half-registered: the row rolled back, so the files go too.
        if revision is not None:
            shutil.rmtree(revision.directory, ignore_errors=True)
        raise
    return "completed"


def _report(result: PipelineResult) -> dict[str, Any]:
    data = result.to_dict()
    data.pop("output_dir", None)
    retention = data.get("retention")
    if retention and len(retention.get("per_tensor", {})) > 20:  # keep the row small: the worst 20
        worst = sorted(retention["per_tensor"].items(), key=lambda kv: kv[1])[:20]
        retention["per_tensor"] = dict(worst)
    return data
