"""Calibration uploads: validation with line numbers, the streaming size limit, the project boundary."""

from __future__ import annotations

import hashlib
import json

from django.conf import settings

from jobs.models import CalibrationFile

from ..helpers import People, error_of

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_a_valid_file_is_processed_and_stored_with_its_hash(people: People, calibration_bytes: bytes) -> None:
    response = people.alice.upload_file(calibration_bytes, name="support.jsonl")
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"].startswith("file-") and body["status"] == "processed" and body["filename"] == "support.jsonl"
    assert body["report"]["conversations"] == 120 and body["report"]["errors"] == []
    assert body["sha256"] == hashlib.sha256(calibration_bytes).hexdigest() and body["size_bytes"] == len(calibration_bytes)
    assert CalibrationFile.objects.get(pk=body["id"]).path.read_bytes() == calibration_bytes
    assert people.alice.get(f"/v1/files/{body['id']}").json() == body
    assert [f["id"] for f in people.bob.get("/v1/files").json()["data"]] == [body["id"]]


def test_every_bad_line_is_reported_with_its_number(people: People) -> None:
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        "",
        json.dumps({"messages": [{"role": "tool", "content": "42"}]}),
        json.dumps(GOOD),
    ]
    body = people.alice.upload_file("\n".join(lines).encode()).json()
    assert body["status"] == "error"
    report = body["report"]
    assert report["conversations"] == 2 and report["error_count"] == 3
    assert [e["line"] for e in report["errors"]] == [2, 3, 5]
    assert "role" in report["errors"][1]["message"] and "wizard" in report["errors"][1]["message"]
    assert report["summary"].startswith("line 2:")


def stored_files() -> set[str]:
    folder = settings.ARTIFACT_ROOT / "files"
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def test_a_file_over_the_limit_is_refused_while_streaming_and_nothing_is_kept(people: People) -> None:
    limit = settings.CALIBRATION_MAX_BYTES
    assert limit == 64 * 1024 * 1024
    before = stored_files()
    line = (json.dumps(GOOD) + "\n").encode()
    # One line over: the request's declared length passes the header check, so the streaming
    # handler is what stops it.
    just_over = line * (limit // len(line) + 1)
    status, code, message = error_of(people.alice.upload_file(just_over))
    assert (status, code) == (413, "payload_too_large")
    assert message == "The calibration file is larger than the limit of 64 MiB; nothing was stored"
    # Far over: refused from the declared length before the body is read.
    status, _, message = error_of(people.alice.upload_file(just_over + line * 2000))
    assert status == 413 and message.startswith("The calibration file is larger than the limit of 64 MiB (request body of")
    assert CalibrationFile.objects.count() == 0 and stored_files() == before


def test_a_file_exactly_at_the_limit_is_accepted(people: People) -> None:
    from django.test import override_settings

    content = (json.dumps(GOOD) + "\n").encode() * 50
    with override_settings(CALIBRATION_MAX_BYTES=len(content)):
        assert people.alice.upload_file(content).status_code == 201
        assert error_of(people.alice.upload_file(content + b"\n"))[0] == 413


def test_upload_errors_name_the_field(people: People) -> None:
    assert error_of(people.alice.post("/v1/files", data={"purpose": "calibration"})) == (
        400, "invalid_request", "file: a file is required (multipart/form-data field 'file')"
    )
    assert error_of(people.alice.upload_file(b"{}", purpose="fine-tune"))[2] == (
        "purpose: must be one of calibration, not 'fine-tune'"
    )


def test_another_projects_file_is_not_found(people: People, calibration_bytes: bytes) -> None:
    body = people.alice.upload_file(calibration_bytes).json()
    assert error_of(people.charlie.get(f"/v1/files/{body['id']}")) == (404, "file_not_found", f"Calibration file {body['id']} not found")
    assert people.charlie.get("/v1/files").json()["data"] == []


def test_a_line_nested_too_deeply_is_a_line_error_not_a_server_error(people: People) -> None:
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = people.alice.upload_file(f"{json.dumps(GOOD)}\n{deep}\n".encode())
    assert response.status_code == 201, response.text[:500]
    report = response.json()["report"]
    assert report["errors"] == [{"line": 2, "message": "not valid JSON (nested too deeply)"}]


def test_values_quoted_in_line_errors_are_cut_short(people: People) -> None:
    huge_role = "r" * (2 * 1024 * 1024)
    line = json.dumps({"messages": [{"role": huge_role, "content": "x"}]})
    response = people.alice.upload_file((line + "\n").encode())
    assert response.status_code == 201 and len(response.content) < 4096
    (error,) = response.json()["report"]["errors"]
    assert error["message"] == (
        "messages[0].role must be one of system, user, assistant, tool, not 'rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr… (2,097,154 characters)"
    )
    assert len(people.alice.get("/v1/files").content) < 4096


def test_one_line_as_long_as_the_limit_is_read_in_linear_time(people: People) -> None:
    # Read line by line through the uploaded file's own iterator, which joins its chunks one at a
    # time, this line cost 21 s of CPU on a 2-core machine; read in chunks and split, well under one.
    import time

    head = b'{"messages": [{"role": "user", "content": "'
    tail = b'"}, {"role": "assistant", "content": "hello"}]}\n'
    other = (json.dumps(GOOD) + "\n").encode()
    body = head + b"x" * (settings.CALIBRATION_MAX_BYTES - len(head) - len(tail) - 2 * len(other) - 1) + tail
    start = time.process_time()
    response = people.alice.upload_file(other + body[:-1] + b",\n" + other)
    spent = time.process_time() - start
    report = response.json()["report"]
    assert response.status_code == 201 and report["conversations"] == 2
    assert [e["line"] for e in report["errors"]] == [2]
    assert spent < 8, f"{spent:.1f} s of CPU for one 64 MiB line"
