"""The service under test: a live HTTP server, a real worker process, tiny models, three users.

alice owns project A and bob is her teammate (his own key on A); charlie is an outsider with
project C. Every test that reads an object checks that charlie can't.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
from django.conf import settings
from django.db import connection
from django.test import override_settings

from fp4prep.statuses import TERMINAL
from tests.pipeline.conftest import save_adapter, save_tiny_base, write_conversations

ROOT = Path(__file__).resolve().parents[2]
TINY_BASE_ID = "tests/tiny-llama"
TINY_RECIPE = {
    "calibration_tokens": 2048,
    "sequence_length": 128,
    "parity_prompts": 3,
    "continuation_tokens": 6,
    # Random tiny models have near-uniform outputs: behaviour thresholds are the demo's business.
    "thresholds": {
        "continuation_top1": 0.0,
        "answer_kl": 1.0,
        "identical_greedy": 0.0,
        "adapter_retention": 0.5,
        "reload_max_logit_diff": 1e-3,
    },
}


@pytest.fixture(scope="session", autouse=True)
def service_paths(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One artifact store for the test process and its workers; one queue name for this session."""
    root = tmp_path_factory.mktemp("artifacts")
    with override_settings(
        ARTIFACT_ROOT=root,
        WEIGHTS_ROOT=root / "weights",
        QUEUE_PREFIX=f"fp4test-{uuid.uuid4().hex[:8]}",
        HEARTBEAT_TIMEOUT=6.0,  # roomy: a loaded 2-core CI machine must not look like a dead worker
        HEARTBEAT_INTERVAL=0.5,
    ):
        yield root


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny") / "base", "llama", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_adapter_archive(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    adapter = save_adapter(tiny_base, tmp_path_factory.mktemp("adapter") / "adapter", targets=["q_proj", "v_proj", "down_proj"])
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(adapter, arcname="my-adapter")
    return buffer.getvalue()


@pytest.fixture(scope="session")
def calibration_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_conversations(tmp_path_factory.mktemp("calibration") / "c.jsonl", 120).read_bytes()


def lora_weights(modules: dict[str, tuple[int, int]] | None = None, r: int = 4) -> bytes:
    """An adapter_model.safetensors of LoRA pairs (``module: (out, in)``); by default the tiny
    Llama's first q_proj, with a non-zero B as after training."""
    import torch
    from safetensors.torch import save

    tensors = {}
    for module, (out, inp) in (modules or {"model.layers.0.self_attn.q_proj": (64, 64)}).items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.full((r, inp), 0.01)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.full((out, r), 0.02)
    return save(tensors)


@pytest.fixture
def catalogue(transactional_db: Any, tiny_base: Path) -> Any:
    """A CPU catalogue entry for the tiny model (the catalogue is data: tests add their own row)."""
    from fp4prep.pipeline.adapter_files import base_weight_shapes
    from registry.models import SupportedBase

    return SupportedBase.objects.create(
        slug="tiny-llama",
        family="Tiny-Llama",
        accepted_base_ids=[TINY_BASE_ID],
        served_base_id="tests/tiny-llama-nvfp4",
        quantization="nvfp4",
        recipe=TINY_RECIPE,
        user_token_minimum=256,
        typical_hours=Decimal("0.05"),
        gpu_count=0,
        price_per_gpu_hour=Decimal("2.00"),
        worker_kind="cpu",
        weights_location=str(tiny_base),
        weight_shapes=base_weight_shapes(tiny_base),
    )


@dataclass
class Api:
    """A client for the real HTTP API (requests against the live server)."""

    base_url: str
    key: str

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def request(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> requests.Response:
        return requests.request(method, self.base_url + path, headers={**self._headers(), **(headers or {})}, timeout=60, **kwargs)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, json: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("POST", path, json=json, **kwargs)

    def upload_file(self, content: bytes, name: str = "calibration.jsonl", purpose: str = "calibration") -> requests.Response:
        return self.post("/v1/files", files={"file": (name, content)}, data={"purpose": purpose})

    def register_adapter(self, archive: bytes, base_model: str = TINY_BASE_ID, name: str = "support-bot", **data: str) -> requests.Response:
        return self.post("/v1/models", files={"file": ("adapter.tar.gz", archive)}, data={"base_model": base_model, "name": name, **data})

    def estimate(self, **inputs: Any) -> requests.Response:
        return self.post("/v1/post-training/prepare-for-fp4-inference/estimate", json={"inputs": inputs})

    def create(self, **inputs: Any) -> requests.Response:
        return self.post("/v1/post-training/prepare-for-fp4-inference", json={"inputs": inputs})

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.get(f"/v1/post-training/prepare-for-fp4-inference/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.get(f"/v1/post-training/prepare-for-fp4-inference/{job_id}/events").json()["data"]

    def cancel(self, job_id: str) -> requests.Response:
        return self.post(f"/v1/post-training/prepare-for-fp4-inference/{job_id}/cancel")

    def wait(self, job_id: str, statuses: frozenset[str] | set[str] = TERMINAL, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job['status']} after {timeout}s: {self.events(job_id)}")
            time.sleep(0.2)


def error_of(response: requests.Response) -> tuple[int, str, str]:
    body = response.json()
    return response.status_code, body["error"]["code"], body["error"]["message"]


@dataclass
class People:
    alice: Api
    bob: Api
    charlie: Api
    project_a: Any
    project_c: Any


@pytest.fixture
def people(live_server: Any, transactional_db: Any) -> People:
    from django.contrib.auth import get_user_model

    from registry.models import ApiKey
    from registry.services import create_project

    users = get_user_model().objects
    alice, bob, charlie = (users.create_user(name, password="pw") for name in ("alice", "bob", "charlie"))
    project_a, alice_key = create_project("Alice's project", Decimal("10.00"), alice)
    project_a.members.add(bob)
    _, bob_key = ApiKey.issue(project_a, "bob's laptop")
    project_c, charlie_key = create_project("Charlie's project", Decimal("10.00"), charlie)
    url = live_server.url
    return People(Api(url, alice_key), Api(url, bob_key), Api(url, charlie_key), project_a, project_c)


def database_url() -> str:
    """The test database, as a DATABASE_URL a worker process can open."""
    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class WorkerProcess:
    def __init__(self, name: str, kind: str, log: Path) -> None:
        self.name, self.kind, self.log = name, kind, log
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "FP4PREP_ARTIFACT_ROOT": str(settings.ARTIFACT_ROOT),
            "FP4PREP_WEIGHTS_ROOT": str(settings.WEIGHTS_ROOT),
            "FP4PREP_QUEUE_PREFIX": settings.QUEUE_PREFIX,
            "FP4PREP_BROKER_URL": settings.BROKER_URL,
            "FP4PREP_WORKER_KIND": kind,
            "FP4PREP_WORKER_SLOTS": "1",
            "FP4PREP_HEARTBEAT_INTERVAL": str(settings.HEARTBEAT_INTERVAL),
            "FP4PREP_HEARTBEAT_TIMEOUT": str(settings.HEARTBEAT_TIMEOUT),
        }
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworker", "--name", name],
            env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_registered(self, timeout: float = 60) -> None:
        from jobs.models import Worker

        deadline = time.monotonic() + timeout
        while not Worker.objects.filter(name=self.name).exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name} did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """As a machine dies: every process of the cluster, at once, no clean-up."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the cluster stops its own processes
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # anything left behind


@pytest.fixture
def start_worker(transactional_db: Any, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(kind: str = "cpu", name: str | None = None) -> WorkerProcess:
        name = name or f"test-{kind}-{len(started)}"
        worker = WorkerProcess(name, kind, tmp_path / f"{name}.log")
        started.append(worker)
        worker.wait_registered()
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def adapter(people: People, catalogue: Any, tiny_adapter_archive: bytes) -> dict[str, Any]:
    """Alice's registered tiny adapter (through the API)."""
    response = people.alice.register_adapter(tiny_adapter_archive)
    assert response.status_code == 201, response.text
    return response.json()


@pytest.fixture
def calibration(people: People, calibration_bytes: bytes) -> dict[str, Any]:
    response = people.alice.upload_file(calibration_bytes)
    assert response.status_code == 201, response.text
    return response.json()


@pytest.fixture
def shipped_catalogue(transactional_db: Any) -> None:
    """The migration's catalogue (GLM-5.3, Kimi-K3, SmolLM2); live-server tests flush tables between tests."""
    from django.apps import apps

    from registry.catalogue import install

    install(apps)
