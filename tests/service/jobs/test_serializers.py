"""The job serializers build their answers directly, for speed: the same answer DRF's fields give."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from jobs import services
from jobs.models import Job
from jobs.serializers import JobDetailSerializer, JobSerializer
from registry.models import Model, Revision
from registry.services import create_project


def test_the_direct_representation_is_drfs_own(transactional_db: Any, catalogue: Any) -> None:
    project, _ = create_project("A", Decimal(5))
    adapter = Model.objects.create(project=project, kind="adapter", name="a", base_model="tests/tiny-llama", supported_base=catalogue)
    revision = Revision.objects.create(model=adapter, number=1, path="x", size_bytes=1, sha256="0" * 64)
    pending = services.create_job(project, {"adapter_object_id": adapter.id})
    running = services.create_job(project, {"adapter_object_id": adapter.id})
    now = timezone.now()
    Job.objects.filter(pk=running.pk).update(
        status="running", stage="calibrating", progress=0.4, worker="w/1", queued_at=now, started_at=now,
        stage_started_at=now - timedelta(seconds=30),
    )
    done = services.create_job(project, {"adapter_object_id": adapter.id})
    Job.objects.filter(pk=done.pk).update(
        status="completed", result_model=adapter, result_revision=revision, finished_at=now, report={"parity": {"top1": 0.9}}
    )
    for job in Job.objects.select_related("supported_base"):
        for cls in (JobSerializer, JobDetailSerializer):
            generic = serializers.ModelSerializer.to_representation(cls(), job)
            direct = cls(job).data
            if generic.get("eta_seconds") is not None:  # time passes between the two calls
                assert abs(direct.pop("eta_seconds") - generic.pop("eta_seconds")) < 1
            assert direct == generic, (job.status, cls.__name__)
    assert pending.status == "pending"
