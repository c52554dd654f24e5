"""Requests built to hurt, second round: bodies no parser should choke on, text past its column,
Django's own errors under /v1/, and uploads racing for the last of a project's quota."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import requests
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings

from jobs.models import CalibrationFile
from registry.models import ApiKey, Model

from ..helpers import People, error_of
from .test_models_api import VALID, tar_gz

JOBS = "/v1/post-training/prepare-for-fp4-inference"
DEEP = "[" * 100_000 + "]" * 100_000
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("path", [JOBS + "/estimate", JOBS, "/v1/models", "/v1/files"])
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"inputs": ' + DEEP + "}", "nested too deeply"),
        ('{"inputs": {"adapter_object_id": ' + "7" * 5000 + "}}", "a number has more than 4,300 digits"),
        ('{"inputs": NaN}', "NaN is not a JSON number"),
    ],
)
def test_json_bodies_no_parser_should_choke_on_are_400s(people: People, path: str, body: str, reason: str) -> None:
    response = people.alice.post(path, data=body.encode(), headers={"Content-Type": "application/json"})
    assert error_of(response) == (400, "invalid_request", f"Request body is not valid JSON: {reason}")


def test_calibration_lines_with_a_5000_digit_number_are_line_errors_on_the_api_and_the_dashboard(people: People) -> None:
    lines = f'{json.dumps(GOOD)}\n{{"messages": [], "n": {"1" * 5000}}}\n{{"messages": {DEEP}}}\n'.encode()
    expected = [
        {"line": 2, "message": "not valid JSON (a number has more than 4,300 digits)"},
        {"line": 3, "message": "not valid JSON (nested too deeply)"},
    ]
    response = people.alice.upload_file(lines)
    assert response.status_code == 201 and response.json()["report"]["errors"] == expected
    page = people.alice.web.post(
        f"/projects/{people.project_a.id}/files/", {"file": SimpleUploadedFile("odd.jsonl", lines)},
        headers={"HX-Request": "true", "HX-Target": "calibration-field"},
    )
    html = page.content.decode()
    assert page.status_code == 200 and "not valid JSON (a number has more than 4,300 digits)" in html
    assert [f.report["errors"] for f in CalibrationFile.objects.filter(project=people.project_a)] == [expected, expected]


def test_text_past_its_column_is_a_400_naming_the_field(people: People, catalogue: Any) -> None:
    archive = tar_gz(VALID)
    assert error_of(people.alice.register_adapter(archive, name="n" * 300_000)) == (
        400, "invalid_request", "name: at most 200 characters, not 300,000"
    )
    assert error_of(people.alice.register_adapter(archive, base_model="b" * 201)) == (
        400, "invalid_request", "base_model: at most 200 characters, not 201"
    )
    assert not Model.objects.filter(project=people.project_a).exists()
    # Django cuts an uploaded file's name to 255 characters as it parses the body, keeping its extension.
    upload = people.alice.upload_file(json.dumps(GOOD).encode(), name="f" * 300 + ".jsonl").json()
    assert upload["filename"] == "f" * 249 + ".jsonl"
    page = people.alice.web.post(f"/projects/{people.project_a.id}/keys/", {"name": "k" * 101})
    assert page.status_code == 400 and "name: at most 100 characters, not 101" in page.content.decode()
    assert not ApiKey.objects.filter(project=people.project_a, name__startswith="kkk").exists()
    # What is not found is quoted short.
    status, code, message = error_of(people.alice.get(f"{JOBS}/{'j' * 5000}"))
    assert (status, code) == (404, "job_not_found") and len(message) < 200


def test_errors_django_raises_itself_answer_in_the_envelope_under_v1(people: People) -> None:
    assert error_of(people.alice.get("/v1/no-such-endpoint")) == (
        404, "not_found", "No API endpoint at this path; the endpoints are listed at /v1/docs"
    )
    # A form field larger than Django reads into memory, on an upload endpoint (which has no
    # body limit of its own before the view): Django raises RequestDataTooBig itself.
    response = people.alice.post("/v1/files", data={"purpose": "x" * (2 * 1024 * 1024)}, files={"file": ("c.jsonl", b"{}\n")})
    assert error_of(response) == (413, "payload_too_large", "Request body is larger than this endpoint accepts")
    response = people.alice.post("/v1/files", data={f"f{i}": "1" for i in range(1500)}, files={"file": ("c.jsonl", b"{}\n")})
    assert error_of(response) == (400, "invalid_request", "Request has more form fields or files than any endpoint takes")
    assert "text/html" in requests.get(people.alice.base_url + "/no-such-page", timeout=60).headers["Content-Type"]


def test_a_500_under_v1_is_the_envelope_and_elsewhere_the_page(transactional_db: Any) -> None:
    from django.test import RequestFactory
    from django.urls import get_resolver

    handler = get_resolver().resolve_error_handler(500)
    api = handler(RequestFactory().get("/v1/whoami"))
    assert api.status_code == 500 and json.loads(api.content) == {
        "error": {"code": "internal_error", "message": "Internal error; it is logged for support. Try again in a moment"}
    }
    page = handler(RequestFactory().get("/projects/x/"))
    assert page.status_code == 500 and b"Something went wrong on our side" in page.content


def test_the_quota_holds_when_uploads_race_for_its_last_space(people: People) -> None:
    line = (json.dumps({"messages": [{"role": "user", "content": "x" * 900}, {"role": "assistant", "content": "ok"}]}) + "\n").encode()
    content = line * (4 * 1024 * 1024 // len(line))
    start = threading.Barrier(4)
    answers: list[requests.Response] = []

    def upload() -> None:
        start.wait()
        answers.append(people.alice.upload_file(content))

    with override_settings(PROJECT_STORAGE_BYTES=int(len(content) * 2.5)):
        threads = [threading.Thread(target=upload) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(a.status_code for a in answers) == [201, 201, 413, 413], [a.text[:200] for a in answers]
    refused = [error_of(a) for a in answers if a.status_code == 413]
    assert all(code == "storage_quota_exceeded" and "Nothing was stored" in message for _, code, message in refused)
    assert CalibrationFile.objects.filter(project=people.project_a).count() == 2
    assert people.project_a.stored_bytes() == 2 * len(content)
