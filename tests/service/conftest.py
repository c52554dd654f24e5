"""The service under test: a live HTTP server, a real worker process, tiny models, three users.

alice owns project A and bob is her teammate (his own key on A); charlie is an outsider with
project C. Every test that reads an object checks that charlie can't.
"""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from tests.tiny import save_adapter, save_tiny_base, write_conversations

from .helpers import TINY_BASE_ID, TINY_RUN_SETTINGS, People, Person, WorkerProcess


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
        # The production hasher costs ~0.5 s per password on a 2-core machine and every test signs
        # people up; a cheap one first (PBKDF2 kept so hashes made by a subprocess still verify).
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher", "django.contrib.auth.hashers.PBKDF2PasswordHasher"],
        # Every test's client is 127.0.0.1: the rate for requests without a valid key would pool
        # them all. test_limits.py sets it low where it is the subject.
        API_ADDRESS_RATE="100000/min",
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


@pytest.fixture
def catalogue(transactional_db: Any, tiny_base: Path) -> Any:
    """A CPU catalogue entry for the tiny model (the catalogue is data: tests add their own row)."""
    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
    from registry.models import SupportedBase

    return SupportedBase.objects.create(
        slug="tiny-llama",
        family="Tiny-Llama",
        accepted_base_ids=[TINY_BASE_ID],
        served_base_id="tests/tiny-llama-nvfp4",
        quantization="nvfp4",
        run_settings=TINY_RUN_SETTINGS,
        user_token_minimum=256,
        typical_hours=Decimal("0.05"),
        gpu_count=0,
        price_per_gpu_hour=Decimal("2.00"),
        worker_kind="cpu",
        weights_location=str(tiny_base),
        weight_shapes=base_weight_shapes(tiny_base),
    )


@pytest.fixture
def people(live_server: Any, transactional_db: Any) -> People:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from registry.models import ApiKey
    from registry.services import create_project

    users = get_user_model().objects
    alice, bob, charlie = (users.create_user(name, password="pw") for name in ("alice", "bob", "charlie"))
    project_a, alice_key = create_project("Alice's project", Decimal("10.00"), alice)
    project_a.members.add(bob)
    _, bob_key = ApiKey.issue(project_a, "bob's laptop")
    project_c, charlie_key = create_project("Charlie's project", Decimal("10.00"), charlie)

    def person(user: Any, key: str) -> Person:
        web = Client()
        web.force_login(user)
        return Person(live_server.url, key, user=user, web=web)

    return People(person(alice, alice_key), person(bob, bob_key), person(charlie, charlie_key), project_a, project_c)


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
    """The shipped catalogue (GLM-5.3, Kimi-K3, SmolLM2), as the migrations install it; live-server tests
    flush tables between tests, so it is installed again."""
    from registry.catalogue import install

    install()
