"""Faults with the real services: PostgreSQL and Redis restarted under a running job, the disk filling
up during export. Each job ends in a defined state or goes on, with nothing half-registered and its
hold settled exactly once. (A worker killed mid-layer: test_job_runs.)

The PostgreSQL and Redis cases restart this machine's servers, so they run in CI's PostgreSQL and
Redis pass; the disk case mounts a small tmpfs and needs root, as CI has.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from jobs.models import Job, Worker
from registry.models import Model

from ..helpers import People, ledger_of, wait_for


def uses_postgres() -> bool:
    return connection.vendor == "postgresql"


def stage_of(job_id: str) -> tuple[str, str]:
    return tuple(Job.objects.filter(pk=job_id).values_list("status", "stage").get())  # type: ignore[return-value]


def deep_adapter(people: People, catalogue: Any, tmp_path: Path, tokenizer_dir: Path, layers: int = 16) -> dict[str, Any]:
    """An adapter on a base deep enough that calibrating and exporting take seconds each."""
    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
    from tests.pipeline.bases import random_llama
    from tests.tiny import save_adapter

    deep = random_llama(tmp_path / "deep", tokenizer_dir, layers=layers, hidden=256, intermediate=1024)
    catalogue.weights_location = str(deep)
    catalogue.weight_shapes = base_weight_shapes(deep)
    catalogue.save()
    adapter_dir = save_adapter(deep, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.01)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(adapter_dir, arcname="deep-adapter")
    response = people.alice.register_adapter(archive.getvalue())
    assert response.status_code == 201, response.text
    return response.json()


def completed_once(people: People, job_id: str) -> None:
    events = people.alice.events(job_id)
    assert people.alice.job(job_id)["status"] == "completed", [(e["type"], e["message"]) for e in events]
    assert ledger_of(job_id) == ["hold", "charge"]
    prepared = Model.objects.get(kind="prepared", source_adapter__jobs__id=job_id)
    assert prepared.revisions.filter(job_id=job_id).count() == 1


# --- PostgreSQL ------------------------------------------------------------------------------------


def restart_postgres() -> None:
    clusters = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True).stdout.split()
    version, name = clusters[0], clusters[1]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, "restart", "-m", "fast"], check=True, timeout=120)


def test_a_job_goes_on_through_a_postgresql_restart(
    people: People, catalogue: Any, start_worker: Any, tmp_path: Path, tokenizer_dir: Path
) -> None:
    if not uses_postgres():
        pytest.skip("restarts PostgreSQL: runs in CI's PostgreSQL pass")
    adapter = deep_adapter(people, catalogue, tmp_path, tokenizer_dir)
    job = people.alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")
    wait_for(lambda: stage_of(job["id"]) == ("running", "calibrating"), timeout=120, what="calibration", interval=0.05)
    restart_postgres()
    connection.close()  # this process's connection went with the server
    people.alice.wait(job["id"], timeout=300)
    completed_once(people, job["id"])
    stages = [e["data"]["stage"] for e in people.alice.events(job["id"]) if e["type"] == "JOB_STAGE"]
    assert stages == ["merging", "calibrating", "quantizing", "exporting", "validating", "uploading"]


# --- Redis -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_stopped() -> Iterator[None]:
    """Stop this machine's Redis (it keeps nothing on disk: queued tasks are lost), then start it
    again with the settings it ran with."""
    import redis

    url = settings.BROKER_URL
    client = redis.Redis.from_url(url)
    config = client.config_get("*")
    client.shutdown(nosave=True)
    wait_for(lambda: not _pings(url), timeout=30, what="Redis to stop")
    try:
        yield
    finally:
        args = ["redis-server", "--daemonize", "yes", "--port", config["port"], "--save", "", "--appendonly", "no",
                "--dir", config["dir"]]
        if config.get("bind"):
            args += ["--bind", *config["bind"].split()]
        if config.get("logfile"):
            args += ["--logfile", config["logfile"]]
        subprocess.run(args, check=True, timeout=30)
        wait_for(lambda: _pings(url), timeout=30, what="Redis to start")


def _pings(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def test_a_job_goes_on_through_a_redis_restart_and_one_created_meanwhile_waits_as_pending(
    people: People, catalogue: Any, start_worker: Any, tmp_path: Path, tokenizer_dir: Path
) -> None:
    if not settings.BROKER_URL:
        pytest.skip("restarts Redis: runs in CI's Redis pass")
    adapter = deep_adapter(people, catalogue, tmp_path, tokenizer_dir, layers=8)
    first = people.alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")
    wait_for(lambda: stage_of(first["id"])[0] == "running", timeout=120, what="the first job to run", interval=0.05)
    with redis_stopped():
        # The broker is down: create answers as usual, nothing is lost, the job waits.
        created = people.alice.create(adapter_object_id=adapter["id"])
        assert created.status_code == 201, created.text
        second = created.json()
        assert second["status"] == "pending"
        # Two worker heartbeats: a whole dispatch ran between them, and the job still waits.
        first_beat = Worker.objects.get().last_seen
        wait_for(lambda: Worker.objects.get().last_seen > first_beat, timeout=60, what="a second heartbeat")
        assert Job.objects.get(pk=second["id"]).status == "pending"
    people.alice.wait(first["id"], timeout=300)
    completed_once(people, first["id"])
    people.alice.wait(second["id"], timeout=300)  # dispatched by a heartbeat once the broker was back
    completed_once(people, second["id"])
    messages = [e["message"] for e in people.alice.events(second["id"])]
    assert sum("queued" in m.lower() for m in messages) >= 1


# --- A full disk ---------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 384 MiB tmpfs for the artifact store (the test's uploads, the job's work and its checkpoint;
    AWQ keeps the weights it smoothed there too, so the free-disk check asks for about twice the
    BF16 model)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root, as CI has")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384M", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    balloon = disk / "balloon"
    stat = os.statvfs(disk)
    with balloon.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize)
    return balloon


def test_a_disk_that_fills_up_during_export_ends_the_job_error_and_a_requeue_finishes_it(
    people: People, catalogue: Any, tmp_path: Path, tokenizer_dir: Path, small_disk: Path, start_worker: Any
) -> None:
    from django.test import override_settings

    from jobs import services

    with override_settings(ARTIFACT_ROOT=small_disk):
        adapter = deep_adapter(people, catalogue, tmp_path, tokenizer_dir, layers=16)
        job = people.alice.create(adapter_object_id=adapter["id"]).json()
        start_worker("cpu")
        wait_for(lambda: stage_of(job["id"]) == ("running", "exporting"), timeout=300, what="the export", interval=0.01)
        balloon = fill(small_disk)
        done = people.alice.wait(job["id"], timeout=300)
        events = people.alice.events(job["id"])
        assert done["status"] == "error", [(e["type"], e["message"]) for e in events]
        assert events[-1]["type"] == "SHAPING_ERROR" and events[-1]["message"].startswith("Internal error during exporting")
        assert ledger_of(job["id"]) == ["hold", "release"]
        assert not Model.objects.filter(kind="prepared").exists()
        assert {p.name for p in (small_disk / "models").iterdir()} == {adapter["id"]}  # no checkpoint was stored

        balloon.unlink()  # space again: support requeues, and the new job continues from the calibration
        new = services.requeue(Job.objects.get(pk=job["id"]))
        people.alice.wait(new.id, timeout=300)
        completed_once(people, new.id)
        messages = [e["message"] for e in people.alice.events(new.id)]
        assert f"Requeued from {job['id']} by support; it continues from where that job stopped" in messages
