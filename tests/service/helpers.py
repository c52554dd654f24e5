"""Plain helpers for the service tests: the people and their API clients, the tiny catalogue
entry's run settings, worker processes, waiting for a state, and reading a job's ledger."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from django.db import connection

from fp4prep.statuses import TERMINAL

ROOT = Path(__file__).resolve().parents[2]


TINY_BASE_ID = "tests/tiny-llama"


TINY_RUN_SETTINGS = {
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
class Person(Api):
    """One of the three people every service test has: their API key's client (this object), their
    user, and ``web``, a Django test client signed in as them for the pages."""

    user: Any = None
    web: Any = None


@dataclass
class People:
    alice: Person  # owns project A
    bob: Person  # alice's teammate in project A
    charlie: Person  # an outsider: owns project C
    project_a: Any
    project_c: Any


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


def wait_for(predicate: Any, timeout: float = 120, what: str = "condition", interval: float = 0.1) -> Any:
    """``predicate()``'s first true value, polled until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def ledger_of(job_id: str) -> list[str]:
    """The kinds of the credit transactions a job made, oldest first (``["hold", "charge"]``)."""
    from registry.models import CreditTransaction

    return list(CreditTransaction.objects.filter(job_id=job_id).order_by("created_at", "id").values_list("kind", flat=True))
