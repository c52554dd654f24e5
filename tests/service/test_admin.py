"""The admin console as support staff use it: the support group, job actions, credit, blocking."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse

from jobs import services
from jobs.models import Job
from registry.models import CreditTransaction, Model, Project, Revision
from registry.services import create_project


@pytest.fixture
def support(transactional_db: Any) -> Client:
    from registry.support import ensure_support_group

    ensure_support_group()  # live-server tests flush tables; the migration's post_migrate made it first
    user = User.objects.create_user("sam", password="pw", is_staff=True)
    user.groups.add(Group.objects.get(name="support"))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def job(transactional_db: Any, catalogue: Any) -> Job:
    project, _ = create_project("Acme", Decimal(5))
    adapter = Model.objects.create(project=project, kind="adapter", name="bot", base_model="tests/tiny-llama", supported_base=catalogue)
    Revision.objects.create(model=adapter, number=1, path="x", size_bytes=1, sha256="0" * 64)
    return services.create_job(project, {"adapter_object_id": adapter.id})


def action(client: Client, model: str, name: str, pk: str, reason: str = "asked by the customer") -> Any:
    form = {"action": name, "index": 0, "_selected_action": [pk], "reason": reason}
    return client.post(reverse(f"admin:{model}_changelist"), form, follow=True)


def logged(pk: str) -> list[tuple[str, str]]:
    from django.contrib.admin.models import LogEntry

    return [(e.user.username, e.change_message) for e in LogEntry.objects.filter(object_id=pk).order_by("id")]


def test_support_sees_jobs_with_filters_and_events_inline(support: Client, job: Job) -> None:
    page = support.get(reverse("admin:jobs_job_changelist"), {"status__exact": "pending"})
    assert page.status_code == 200 and job.id in page.content.decode()
    assert job.id not in support.get(reverse("admin:jobs_job_changelist"), {"status__exact": "running"}).content.decode()
    detail = support.get(reverse("admin:jobs_job_change", args=[job.id])).content.decode()
    assert "Job created; waiting for a CPU worker slot" in detail


def test_support_cancels_and_requeues_a_job(support: Client, job: Job) -> None:
    response = action(support, "jobs_job", "cancel", job.id)
    assert f"Job {job.id}: cancellation requested." in response.content.decode()
    job.refresh_from_db()
    assert job.status == "cancelled"  # nothing had started it
    response = action(support, "jobs_job", "requeue", job.id)
    new = Job.objects.exclude(pk=job.pk).get()
    assert f"Job {job.id}: requeued as {new.id}." in response.content.decode()
    assert new.status == "pending" and new.adapter_revision_id == job.adapter_revision_id
    assert new.project.credit().held == Decimal("0.10")
    assert "is not cancellable" in action(support, "jobs_job", "cancel", job.id).content.decode()
    assert logged(job.id) == [("sam", "Cancelled: asked by the customer"), ("sam", f"Requeued as {new.id}: asked by the customer")]


def test_a_failed_job_is_requeued_once_and_a_second_requeue_names_the_first(support: Client, job: Job) -> None:
    Job.objects.filter(pk=job.pk).update(status="error")
    held = job.project.credit().held
    action(support, "jobs_job", "requeue", job.id)
    new = Job.objects.exclude(pk=job.pk).get()
    page = action(support, "jobs_job", "requeue", job.id).content.decode()
    assert f"Job {job.id} was already requeued as {new.id}" in page
    assert Job.objects.count() == 2 and job.project.credit().held == held + Decimal("0.10")
    job.refresh_from_db()
    assert job.requeued_as == new and new.id in support.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert [m for _, m in logged(job.id)] == [f"Requeued as {new.id}: asked by the customer"]


def test_two_requeues_at_once_make_one_job_and_hold_once(job: Job) -> None:
    import threading

    from django.db import connection

    from fp4prep.site.errors import Conflict

    Job.objects.filter(pk=job.pk).update(status="error")
    held = job.project.credit().held
    start = threading.Barrier(2)
    made: list[str] = []
    refused: list[str] = []

    def requeue() -> None:
        try:
            start.wait()
            made.append(services.requeue(Job.objects.get(pk=job.pk)).id)
        except Conflict as exc:
            refused.append(exc.message)
        finally:
            connection.close()

    threads = [threading.Thread(target=requeue) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and refused == [f"Job {job.id} was already requeued as {made[0]}; requeue that job if it fails too"]
    assert Job.objects.count() == 2 and job.project.credit().held == held + Decimal("0.10")


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ("completed", "its model is registered, and a requeue would hold and charge for that work again"),
        ("user_error", "it stopped on its inputs, which would fail the same way"),
        ("pending", "it has not ended"),
    ],
)
def test_requeue_refuses_jobs_that_did_not_end_in_error_or_cancelled_saying_why(
    support: Client, job: Job, status: str, why: str
) -> None:
    Job.objects.filter(pk=job.pk).update(status=status)
    held = job.project.credit().held
    page = action(support, "jobs_job", "requeue", job.id).content.decode()
    assert f"Job {job.id} is {status}; only jobs that ended in error or were cancelled can be requeued: {why}" in page
    assert not Job.objects.exclude(pk=job.pk).exists()
    assert job.project.credit().held == held and logged(job.id) == []


def test_an_action_without_a_reason_changes_nothing(support: Client, job: Job) -> None:
    response = action(support, "jobs_job", "cancel", job.id, reason=" ")
    assert "Say why in the Reason box" in response.content.decode()
    job.refresh_from_db()
    assert job.status == "pending" and logged(job.id) == []
    action(support, "registry_project", "block", job.project_id, reason="")
    assert not Project.objects.get(pk=job.project_id).blocked


def test_support_adjusts_credit_through_the_ledger_with_a_reason(support: Client, job: Job) -> None:
    project = job.project
    url = reverse("admin:registry_credittransaction_add")
    refused = support.post(url, {"project": project.id, "kind": "adjustment", "amount": "-2.00", "note": ""})
    assert "Say why" in refused.content.decode()
    support.post(url, {"project": project.id, "kind": "adjustment", "amount": "-2.00", "note": "refund reversed"})
    entry = CreditTransaction.objects.get(kind="adjustment")
    assert entry.created_by.username == "sam" and entry.amount == Decimal("-2.00")
    assert project.credit().balance == Decimal("3.00")
    change = support.post(reverse("admin:registry_credittransaction_change", args=[entry.pk]), {"amount": "100"})
    assert change.status_code == 403 or CreditTransaction.objects.get(pk=entry.pk).amount == Decimal("-2.00")


def test_support_blocks_and_unblocks_a_project(support: Client, job: Job) -> None:
    action(support, "registry_project", "block", job.project_id, reason="chargeback under review")
    project = Project.objects.get(pk=job.project_id)
    assert project.blocked and project.blocked_reason == "chargeback under review; blocked by sam"
    assert logged(project.id) == [("sam", "Blocked: chargeback under review")]
    with pytest.raises(services.Forbidden):
        services.create_job(project, {"adapter_object_id": job.adapter_id})
    action(support, "registry_project", "unblock", job.project_id)
    assert not Project.objects.get(pk=job.project_id).blocked


def test_the_support_group_has_just_its_permissions(support: Client, job: Job) -> None:
    user = User.objects.get(username="sam")
    assert user.has_perm("jobs.change_job") and user.has_perm("registry.add_credittransaction")
    assert not user.has_perm("jobs.delete_job") and not user.has_perm("registry.change_supportedbase")
    assert not user.has_perm("registry.delete_project") and not user.has_perm("auth.change_user")
    assert support.get(reverse("admin:registry_supportedbase_change", args=["tiny-llama"])).status_code == 200  # view only
    assert support.get(reverse("admin:auth_user_changelist")).status_code == 403


def change_project(client: Client, project: Project, **fields: Any) -> None:
    """Post the project's change form as the browser would: its formsets' management fields included."""
    import re

    url = reverse("admin:registry_project_change", args=[project.id])
    page = client.get(url).content.decode()
    form = dict(re.findall(r'name="([\w-]+-(?:TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS)"[^>]*value="(\d+)"', page))
    client.post(url, {**form, "name": project.name, **fields})


def test_support_can_neither_join_a_project_nor_issue_its_keys(support: Client, job: Job) -> None:
    from registry.models import ApiKey

    project = job.project
    sam = User.objects.get(username="sam")
    change_project(support, project, name="Taken over", members=[sam.pk])
    project.refresh_from_db()
    assert project.name == "Acme" and not project.members.exists()
    assert support.get(reverse("admin:registry_apikey_add")).status_code == 403
    keys = ApiKey.objects.filter(project=project).count()
    # The dashboard's key page belongs to members; staff are no exception.
    assert support.post(f"/projects/{project.id}/keys/", {"name": "mine"}).status_code == 404
    assert ApiKey.objects.filter(project=project).count() == keys


def test_a_superuser_manages_membership(job: Job) -> None:
    root = User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(root)
    change_project(client, job.project, members=[root.pk])
    assert list(Project.objects.get(pk=job.project_id).members.all()) == [root]


def test_a_catalogue_entry_edited_in_the_admin_with_run_settings_the_pipeline_cannot_take_is_refused_naming_the_field(
    catalogue: Any,
) -> None:
    import json

    root = User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(root)
    url = reverse("admin:registry_supportedbase_change", args=[catalogue.pk])
    form = {
        "slug": catalogue.slug, "family": catalogue.family, "accepted_base_ids": json.dumps(catalogue.accepted_base_ids),
        "served_base_id": catalogue.served_base_id, "quantization": catalogue.quantization,
        "user_token_minimum": catalogue.user_token_minimum, "typical_hours": catalogue.typical_hours,
        "gpu_count": catalogue.gpu_count, "price_per_gpu_hour": catalogue.price_per_gpu_hour,
        "worker_kind": catalogue.worker_kind, "weights_location": catalogue.weights_location,
        "weights_format": catalogue.weights_format,
        "weight_shapes": json.dumps(catalogue.weight_shapes), "active": "on",
        "profiles-TOTAL_FORMS": 0, "profiles-INITIAL_FORMS": 0, "profiles-MIN_NUM_FORMS": 0, "profiles-MAX_NUM_FORMS": 1000,
    }
    refused = client.post(url, {**form, "run_settings": json.dumps({"sequence_length": "long"})})
    assert refused.status_code == 200  # the form again, with the error
    assert "run_settings.sequence_length: must be a whole number, not &#x27;long&#x27;" in refused.content.decode()
    catalogue.refresh_from_db()
    assert catalogue.run_settings["sequence_length"] == 128
    saved = client.post(url, {**form, "run_settings": json.dumps({**catalogue.run_settings, "sequence_length": 256})})
    assert saved.status_code == 302
    catalogue.refresh_from_db()
    assert catalogue.run_settings["sequence_length"] == 256
