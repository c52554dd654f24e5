"""Estimate and create over HTTP: every documented error, holds and the boundary."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from registry.models import Model, Project

from ..helpers import People, error_of

JOBS = "/v1/post-training/prepare-for-fp4-inference"


def test_estimate_reports_price_time_and_credit_without_holding_anything(people: People, adapter: dict[str, Any]) -> None:
    response = people.alice.estimate(adapter_object_id=adapter["id"], adapter_revision_id=adapter["latest_revision"]["id"])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["price_usd"] == 0.10 and body["time_hours"] == 0.05 and body["allowed_to_proceed"] is True
    assert body["available_usd"] == 10.0 and body["reason"] == ""
    assert people.alice.get("/v1/whoami").json()["held_usd"] == 0


def test_the_shipped_catalogue_prices_glm_and_kimi(people: People, shipped_catalogue: None, tiny_adapter_archive: bytes) -> None:
    Project.objects.get(pk=people.project_a.pk).add_credit(Decimal(200), "top-up")
    for base, price, hours in (("zai-org/GLM-5.3-FP8", 43.14, 6.0), ("zai-org/GLM-5.3-NVFP4", 43.14, 6.0), ("moonshotai/Kimi-K3", 129.43, 18.0)):
        adapter = people.alice.register_adapter(tiny_adapter_archive, base_model=base).json()
        body = people.alice.estimate(adapter_object_id=adapter["id"]).json()
        assert (body["price_usd"], body["time_hours"], body["allowed_to_proceed"]) == (price, hours, True), base


def test_an_adapter_on_an_unsupported_base_is_refused(people: People, catalogue: Any, tiny_adapter_archive: bytes) -> None:
    adapter = people.alice.register_adapter(tiny_adapter_archive, base_model="meta-llama/Llama-3.1-8B").json()
    for call in (people.alice.estimate, people.alice.create):
        assert error_of(call(adapter_object_id=adapter["id"])) == (
            400, "unsupported_base", "Preparing an adapter on base model meta-llama/Llama-3.1-8B is not supported"
        )


@pytest.mark.parametrize("kind", ["base", "merged", "prepared"])
def test_a_model_that_is_not_an_adapter_is_refused(people: People, catalogue: Any, kind: str) -> None:
    model = Model.objects.create(project=people.project_a, kind=kind, name="m", base_model="tests/tiny-llama")
    for call in (people.alice.estimate, people.alice.create):
        assert error_of(call(adapter_object_id=model.id)) == (400, "not_an_adapter", f"model {model.id} is not an adapter")


def test_a_public_base_model_is_not_an_adapter(people: People, shipped_catalogue: None) -> None:
    base = Model.objects.get(project__isnull=True, name="zai-org/GLM-5.3-FP8")
    assert error_of(people.alice.estimate(adapter_object_id=base.id)) == (400, "not_an_adapter", f"model {base.id} is not an adapter")


def test_a_full_weight_fine_tune_is_refused(people: People, catalogue: Any) -> None:
    model = Model.objects.create(project=people.project_a, kind="full", name="full", base_model="tests/tiny-llama")
    assert error_of(people.alice.create(adapter_object_id=model.id)) == (
        400, "no_fine_tuning_relation", f"model {model.id} does not record a fine-tuning relation"
    )


def test_another_projects_adapter_does_not_exist_here(people: People, adapter: dict[str, Any]) -> None:
    for call in (people.charlie.estimate, people.charlie.create):
        assert error_of(call(adapter_object_id=adapter["id"])) == (
            404, "model_not_found", f"model {adapter['id']} does not exist in this project"
        )
    assert error_of(people.alice.estimate(adapter_object_id="ml_absent")) == (
        404, "model_not_found", "model ml_absent does not exist in this project"
    )


def test_a_teammates_key_sees_the_same_project(people: People, adapter: dict[str, Any]) -> None:
    assert people.bob.estimate(adapter_object_id=adapter["id"]).status_code == 200


def test_a_calibration_file_must_exist_in_this_project_and_pass_validation(
    people: People, adapter: dict[str, Any], calibration_bytes: bytes
) -> None:
    foreign = people.charlie.upload_file(calibration_bytes).json()
    bad = people.alice.upload_file(b'{"messages": "nope"}\n').json()
    assert bad["status"] == "error"
    for call in (people.alice.estimate, people.alice.create):
        assert error_of(call(adapter_object_id=adapter["id"], calibration_file_id=foreign["id"])) == (
            404, "file_not_found", f"Calibration file {foreign['id']} not found"
        )
        assert error_of(call(adapter_object_id=adapter["id"], calibration_file_id="file-absent")) == (
            404, "file_not_found", "Calibration file file-absent not found"
        )
        assert error_of(call(adapter_object_id=adapter["id"], calibration_file_id=bad["id"])) == (
            400, "file_invalid", f"Calibration file {bad['id']} did not pass validation"
        )


def test_a_revision_of_another_model_is_not_found(people: People, adapter: dict[str, Any], tiny_adapter_archive: bytes) -> None:
    other = people.alice.register_adapter(tiny_adapter_archive).json()
    status, code, message = error_of(
        people.alice.estimate(adapter_object_id=adapter["id"], adapter_revision_id=other["latest_revision"]["id"])
    )
    assert (status, code) == (404, "revision_not_found") and adapter["id"] in message


def test_credit_that_cannot_cover_the_price_warns_on_estimate_and_refuses_create(people: People, adapter: dict[str, Any]) -> None:
    project = Project.objects.get(pk=people.project_a.pk)
    project.add_credit(Decimal("-9.95"), "support adjustment")  # $0.05 left for a $0.10 job
    estimate = people.alice.estimate(adapter_object_id=adapter["id"]).json()
    assert estimate["allowed_to_proceed"] is False and "$0.10" in estimate["reason"] and "$0.05" in estimate["reason"]
    status, code, message = error_of(people.alice.create(adapter_object_id=adapter["id"]))
    assert (status, code) == (402, "insufficient_credit")
    assert "price $0.10" in message and "credit $0.05" in message
    assert people.alice.get(JOBS).json()["total"] == 0


def test_a_blocked_project_cannot_start_jobs(people: People, adapter: dict[str, Any]) -> None:
    Project.objects.get(pk=people.project_a.pk).block("unpaid invoice")
    estimate = people.alice.estimate(adapter_object_id=adapter["id"]).json()
    assert estimate["allowed_to_proceed"] is False and "blocked" in estimate["reason"]
    status, code, message = error_of(people.alice.create(adapter_object_id=adapter["id"]))
    assert (status, code) == (403, "project_blocked")
    assert message == f"Project {people.project_a.id} is blocked from starting jobs (unpaid invoice). Contact support."


def test_create_holds_the_price_and_each_request_is_a_new_pending_job(people: People, adapter: dict[str, Any]) -> None:
    first = people.alice.create(adapter_object_id=adapter["id"]).json()
    second = people.alice.create(adapter_object_id=adapter["id"]).json()
    assert first["id"] != second["id"] and first["status"] == second["status"] == "pending"
    credit = people.alice.get("/v1/whoami").json()
    assert (credit["balance_usd"], credit["held_usd"], credit["available_usd"]) == (10.0, 0.2, 9.8)
    listed = people.alice.get(JOBS).json()
    assert [j["id"] for j in listed["data"]] == [second["id"], first["id"]]  # newest first
    assert people.charlie.get(JOBS).json()["total"] == 0


def test_job_lists_paginate(people: People, adapter: dict[str, Any]) -> None:
    ids = [people.alice.create(adapter_object_id=adapter["id"]).json()["id"] for _ in range(3)]
    page = people.alice.get(JOBS, params={"page_size": 2}).json()
    assert page["total"] == 3 and [j["id"] for j in page["data"]] == ids[::-1][:2] and page["next"]
    rest = people.alice.get(JOBS, params={"page_size": 2, "page": 2}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["next"] is None


@pytest.mark.parametrize("body", [{}, {"inputs": {}}, {"inputs": {"adapter_object_id": 7}}, {"inputs": "ml_x"}])
def test_a_malformed_body_names_the_field(people: People, catalogue: Any, body: dict[str, Any]) -> None:
    status, code, message = error_of(people.alice.post(f"{JOBS}/estimate", json=body))
    assert (status, code) == (400, "invalid_request") and ("inputs" in message)


@pytest.mark.parametrize("field", ["adapter_object_id", "adapter_revision_id", "calibration_file_id"])
def test_an_id_holding_a_lone_surrogate_is_a_400_naming_the_field(people: People, adapter: dict[str, Any], field: str) -> None:
    inputs = {"adapter_object_id": adapter["id"], field: "ml_\ud800"}
    for path in (f"{JOBS}/estimate", JOBS):
        status, code, message = error_of(people.alice.post(path, json={"inputs": inputs}))
        assert (status, code) == (400, "invalid_request") and message == f"inputs.{field}: 'ml_\\ud800' holds a character no ID has"
    assert people.alice.get(JOBS).json()["data"] == []


@pytest.mark.parametrize("after", ["²", "①", "1" * 5000, "-1"])
def test_an_events_cursor_that_is_not_a_whole_number_is_a_400(people: People, adapter: dict[str, Any], after: str) -> None:
    job = people.alice.create(adapter_object_id=adapter["id"]).json()
    status, _, message = error_of(people.alice.get(f"{JOBS}/{job['id']}/events", params={"after": after}))
    assert (status, message) == (400, "after: must be an event id (a whole number)")


def test_requests_without_a_valid_key_are_refused(people: People) -> None:
    people.alice.key = ""
    assert error_of(people.alice.get(JOBS))[:2] == (401, "authentication_failed")
    people.alice.key = "fp4_not-a-key"
    assert error_of(people.alice.get(JOBS)) == (401, "authentication_failed", "API key is not valid or was revoked")


def test_an_unknown_job_is_not_found(people: People, catalogue: Any) -> None:
    for path in ("", "/events"):
        assert error_of(people.alice.get(f"{JOBS}/shp-quant-00000000-0000{path}")) == (
            404, "job_not_found", "Shaping job shp-quant-00000000-0000 not found"
        )
    assert error_of(people.alice.cancel("shp-quant-00000000-0000"))[:2] == (404, "job_not_found")


def test_a_retried_create_with_its_idempotency_key_returns_the_first_job_and_holds_once(people: People, adapter: dict[str, Any]) -> None:
    body = {"inputs": {"adapter_object_id": adapter["id"]}}
    first = people.alice.post(JOBS, json=body, headers={"Idempotency-Key": "retry-me-1"})
    again = people.alice.post(JOBS, json=body, headers={"Idempotency-Key": "retry-me-1"})
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert people.alice.get(JOBS).json()["total"] == 1
    assert people.alice.get("/v1/whoami").json()["held_usd"] == 0.10
    # A new key is a new job; the same key in another project is that project's own.
    assert people.alice.post(JOBS, json=body, headers={"Idempotency-Key": "retry-me-2"}).json()["id"] != first.json()["id"]
    assert people.alice.get("/v1/whoami").json()["held_usd"] == 0.20


def test_an_idempotency_key_reused_for_other_inputs_is_a_conflict(people: People, adapter: dict[str, Any], calibration: dict[str, Any]) -> None:
    headers = {"Idempotency-Key": "k-1"}
    first = people.alice.post(JOBS, json={"inputs": {"adapter_object_id": adapter["id"]}}, headers=headers).json()
    other = people.alice.post(
        JOBS, json={"inputs": {"adapter_object_id": adapter["id"], "calibration_file_id": calibration["id"]}}, headers=headers
    )
    assert error_of(other) == (
        409, "idempotency_key_reused",
        f"Idempotency-Key 'k-1' was already used by job {first['id']} with other inputs; use a new key for a new job",
    )
    assert error_of(people.alice.post(JOBS, json={"inputs": {"adapter_object_id": adapter["id"]}}, headers={"Idempotency-Key": "x" * 300}))[:2] == (
        400, "invalid_idempotency_key"
    )
    assert people.alice.get(JOBS).json()["total"] == 1


def test_the_dashboards_confirmation_creates_one_job_when_submitted_twice(people: People, adapter: dict[str, Any]) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client as PageClient

    from jobs.models import Job

    page = PageClient()
    page.force_login(get_user_model().objects.get(username="alice"))
    url = f"/projects/{people.project_a.id}/prepare/"
    estimate = page.post(url + "estimate", {"adapter": adapter["id"]})
    key = estimate.context["idempotency_key"]
    form = {"adapter": adapter["id"], "confirm_price": "0.10", "idempotency_key": key}
    first, second = page.post(url + "create", form), page.post(url + "create", form)
    assert first.status_code == second.status_code == 302 and first["Location"] == second["Location"]
    assert Job.objects.filter(project=people.project_a).count() == 1
