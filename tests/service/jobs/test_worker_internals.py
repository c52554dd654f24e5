"""The worker's own machinery, in this process: the heartbeat through database errors, registration's locks."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from jobs import services, worker
from jobs.models import Job
from registry.models import Model, Revision
from registry.services import create_project

from ..helpers import wait_for


@pytest.fixture
def running_job(transactional_db: Any, catalogue: Any) -> Job:
    project, _ = create_project("Acme", Decimal(5))
    adapter = Model.objects.create(project=project, kind="adapter", name="bot", base_model="tests/tiny-llama", supported_base=catalogue)
    Revision.objects.create(model=adapter, number=1, path="x", size_bytes=1, sha256="0" * 64)
    job = services.create_job(project, {"adapter_object_id": adapter.id})
    long_ago = timezone.now() - timedelta(hours=1)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, worker="w/1", started_at=long_ago, heartbeat_at=long_ago)
    return Job.objects.select_related("supported_base", "adapter", "project").get(pk=job.pk)


def beat(job: Job) -> Any:
    return Job.objects.filter(pk=job.pk).values_list("heartbeat_at", flat=True).get()


def test_the_heartbeat_goes_on_after_database_errors(running_job: Job, caplog: pytest.LogCaptureFixture) -> None:
    with override_settings(HEARTBEAT_INTERVAL=0.05):
        heartbeat = worker.Heartbeat(running_job.id, "w/1")
        heartbeat.start()
        try:
            first = beat(running_job)
            wait_for(lambda: beat(running_job) != first, timeout=10, interval=0.05)
            # The table goes away under the heartbeat's connection: every beat fails for a while.
            with connection.cursor() as cursor:
                cursor.execute("ALTER TABLE jobs_job RENAME TO jobs_job_away")
            wait_for(lambda: "heartbeat not written" in caplog.text, timeout=10, interval=0.05)
            with connection.cursor() as cursor:
                cursor.execute("ALTER TABLE jobs_job_away RENAME TO jobs_job")
            after = timezone.now()
            wait_for(lambda: beat(running_job) > after, timeout=10, interval=0.05)
            assert heartbeat.is_alive()
            assert f"job {running_job.id}: heartbeat not written" in caplog.text  # the beats did fail meanwhile
        finally:
            heartbeat.stop()


def test_registration_hashes_the_checkpoint_before_it_takes_any_lock(running_job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from registry import artifacts

    output = tmp_path / "checkpoint"
    output.mkdir()
    for name in ("config.json", "model.safetensors"):
        (output / name).write_bytes(name.encode() * 1000)
    hashed_inside_a_transaction = []
    real = artifacts.file_sha256

    def observed(path: Path) -> str:
        hashed_inside_a_transaction.append(connection.in_atomic_block)
        return real(path)

    monkeypatch.setattr(artifacts, "file_sha256", observed)
    assert worker.register(running_job, output, {"parity": {}}) == "completed"
    assert hashed_inside_a_transaction == [False, False]
    job = Job.objects.get(pk=running_job.pk)
    assert job.status == "completed" and job.result_revision is not None
    assert {f["path"] for f in job.result_revision.files} == {"config.json", "model.safetensors"}
    assert job.project.credit().held == 0 and job.project.credit().balance == Decimal("4.90")


def test_a_job_cancelled_before_registration_registers_nothing(running_job: Job, tmp_path: Path) -> None:
    output = tmp_path / "checkpoint"
    output.mkdir()
    (output / "config.json").write_text("{}")
    Job.objects.filter(pk=running_job.pk).update(status=Job.Status.CANCEL_REQUESTED)
    assert worker.register(running_job, output, {}) == "cancelled"
    assert Job.objects.get(pk=running_job.pk).status == "cancelled"
    assert not Model.objects.filter(kind="prepared").exists() and output.is_dir()
