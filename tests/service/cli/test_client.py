"""``fp4prep.client`` in-process against the live server, and its retries against a small real HTTP
server that fails on purpose."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fp4prep.client import (
    APIConnectionError,
    Client,
    ConflictError,
    Estimate,
    File,
    InternalServerError,
    Job,
    NotFoundError,
    PaymentRequiredError,
)


@pytest.fixture
def client(people: Any, live_server: Any) -> Client:
    return Client(api_key=people.alice.key, base_url=live_server.url)


def test_the_seeds_examples_read_typed_objects(client: Client, adapter: dict[str, Any], calibration_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "calibration.jsonl"
    path.write_bytes(calibration_bytes)
    calibration = client.files.upload(file=str(path), purpose="calibration")
    assert isinstance(calibration, File) and calibration.status == "processed" and calibration.report.conversations == 120

    fp4 = client.post_training.prepare_for_fp4_inference
    estimate = fp4.estimate_cost(inputs={"adapter_object_id": adapter["id"], "adapter_revision_id": adapter["latest_revision"]["id"]})
    assert isinstance(estimate, Estimate)
    assert (estimate.price_usd, estimate.time_hours, estimate.allowed_to_proceed) == (0.1, 0.05, True)

    job = fp4.create(inputs={"adapter_object_id": adapter["id"], "calibration_file_id": calibration.id})
    assert isinstance(job, Job) and job.id.startswith("shp-quant-") and job.status == "pending"
    assert job.inputs is not None and job.inputs.calibration_file_id == calibration.id and job.results is None
    assert fp4.retrieve(job.id).id == job.id
    assert [j.id for j in fp4.list().data] == [job.id]
    events = fp4.list_events(job.id)
    assert isinstance(events.data[0].created_at, datetime) and events.data[0].type == "JOB_STATUS" and events.data[0].message
    cancelled = fp4.cancel(job.id)
    assert cancelled.status == "cancel_requested"
    with pytest.raises(ConflictError) as conflict:
        fp4.cancel(job.id)
    assert conflict.value.status == 409 and conflict.value.message.startswith(f"Shaping job {job.id} is not cancellable")

    model = client.models.retrieve(adapter["id"])
    assert model.kind == "adapter" and model.latest_revision is not None and model.latest_revision.files
    assert client.whoami().available_usd == 10.0


def test_api_errors_are_typed_with_the_servers_message(client: Client, people: Any) -> None:
    with pytest.raises(NotFoundError) as missing:
        client.post_training.prepare_for_fp4_inference.retrieve("shp-quant-nope")
    assert (missing.value.status, missing.value.code, missing.value.message) == (404, "job_not_found", "Shaping job shp-quant-nope not found")
    with pytest.raises(NotFoundError, match="model ml_nope does not exist in this project"):
        client.post_training.prepare_for_fp4_inference.estimate_cost(inputs={"adapter_object_id": "ml_nope"})


def test_a_project_without_credit_gets_payment_required(client: Client, people: Any, adapter: dict[str, Any]) -> None:
    from decimal import Decimal

    people.project_a.add_credit(Decimal("-10"), "test: empty")
    with pytest.raises(PaymentRequiredError) as refused:
        client.post_training.prepare_for_fp4_inference.create(inputs={"adapter_object_id": adapter["id"]})
    assert refused.value.status == 402 and "exceeds the project's available credit $0.00" in refused.value.message


class Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first ``failures`` requests, then 200; counts what it received."""

    failures = 0
    seen: list[str] = []

    keys: list[str | None] = []

    def _answer(self) -> None:
        Flaky.seen.append(f"{self.command} {self.path}")
        Flaky.keys.append(self.headers.get("Idempotency-Key"))
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if len(Flaky.seen) <= Flaky.failures:
            body, status = {"error": {"code": "unavailable", "message": "try again"}}, 503
        else:
            body, status = {"id": "proj_x", "name": "x", "status": "pending"}, 200
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[str]:
    Flaky.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_reads_and_creates_are_retried_on_5xx_and_a_create_keeps_its_idempotency_key(flaky: str) -> None:
    client = Client(api_key="k", base_url=flaky, max_retries=2, backoff=0.01)
    Flaky.failures = 2
    assert client.whoami().id == "proj_x"
    assert Flaky.seen == ["GET /v1/whoami"] * 3

    Flaky.seen, Flaky.keys, Flaky.failures = [], [], 1
    fp4 = client.post_training.prepare_for_fp4_inference
    assert fp4.create(inputs={"adapter_object_id": "ml_x"}).status == "pending"
    assert Flaky.seen == ["POST /v1/post-training/prepare-for-fp4-inference"] * 2
    first_key = Flaky.keys[0]
    assert first_key and Flaky.keys == [first_key, first_key]  # the retry is the same request
    Flaky.seen, Flaky.keys = [], []
    fp4.create(inputs={"adapter_object_id": "ml_x"})
    assert Flaky.keys[0] not in (None, first_key)  # each create is a new key

    Flaky.seen, Flaky.failures = [], 1
    with pytest.raises(InternalServerError):
        client.request("POST", "/v1/files")
    assert Flaky.seen == ["POST /v1/files"]  # an upload is sent once: it may have been stored

    Flaky.seen, Flaky.failures = [], 5
    with pytest.raises(InternalServerError) as failed:
        client.whoami()
    assert failed.value.status == 503 and failed.value.message == "try again"
    assert len(Flaky.seen) == 3  # one try and two retries


def test_an_unreachable_server_is_a_connection_error_after_retries() -> None:
    client = Client(api_key="k", base_url="http://127.0.0.1:9", max_retries=1, backoff=0.01)
    with pytest.raises(APIConnectionError, match="could not reach http://127.0.0.1:9: connection refused"):
        client.whoami()


def test_the_key_and_server_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4prep.client import ConfigurationError

    monkeypatch.delenv("FP4PREP_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="no API key"):
        Client()
    monkeypatch.setenv("FP4PREP_API_KEY", "fp4_k")
    monkeypatch.setenv("FP4PREP_BASE_URL", "https://fp4prep.example.com/")
    client = Client()
    assert (client.api_key, client.base_url) == ("fp4_k", "https://fp4prep.example.com")
