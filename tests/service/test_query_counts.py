"""Query counts of the list endpoints and the polled job endpoints: constant in the number of rows."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs import services
from jobs.models import CalibrationFile, Job
from registry.models import Model, Revision
from registry.services import create_project

JOBS = "/v1/post-training/prepare-for-fp4-inference"


@pytest.fixture
def client_and_jobs(transactional_db: Any, catalogue: Any) -> tuple[APIClient, list[Job]]:
    project, key = create_project("A", Decimal(100))
    jobs = []
    for i in range(5):
        adapter = Model.objects.create(project=project, kind="adapter", name=f"a{i}", base_model="tests/tiny-llama", supported_base=catalogue)
        for n in (1, 2):
            Revision.objects.create(model=adapter, number=n, path=f"x/{i}/{n}", size_bytes=1, sha256="0" * 64)
        CalibrationFile.objects.create(project=project, filename=f"f{i}", size_bytes=1, sha256="0" * 64, status="processed",
                                       report={"conversations": 1, "error_count": 0, "errors": [], "summary": "ok"})
        job = services.create_job(project, {"adapter_object_id": adapter.id})
        for k in range(3):
            job.event("JOB_STAGE", f"stage {k}")
        jobs.append(job)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    client.get("/v1/whoami")  # records last_used_at, which is written at most every few minutes
    return client, jobs


@pytest.mark.parametrize(
    ("path", "queries"),
    [
        ("/v1/files", 3),  # key, count, page
        ("/v1/models", 4),  # key, count, page, revisions prefetch
        (JOBS, 3),
    ],
)
def test_list_endpoints_take_a_fixed_number_of_queries(
    client_and_jobs: tuple[APIClient, list[Job]], django_assert_num_queries: Any, path: str, queries: int
) -> None:
    client, _ = client_and_jobs
    with django_assert_num_queries(queries):
        response = client.get(path)
    assert response.status_code == 200 and response.json()["total"] >= 5


def test_polling_a_job_and_its_events_takes_a_fixed_number_of_queries(
    client_and_jobs: tuple[APIClient, list[Job]], django_assert_num_queries: Any
) -> None:
    client, jobs = client_and_jobs
    with django_assert_num_queries(2):  # key, the job in the project with its catalogue entry
        assert client.get(f"{JOBS}/{jobs[0].id}").status_code == 200
    with django_assert_num_queries(3):  # key, job lookup, events
        assert len(client.get(f"{JOBS}/{jobs[0].id}/events").json()["data"]) == 4
