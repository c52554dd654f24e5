"""The light install: the wheel, installed without extras into a fresh virtual environment, gives
the Python client and the server commands, which drive a job end to end against the live server;
the pipeline and service commands say in one line what to install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .cli.helpers import env_for
from .helpers import TINY_BASE_ID, People

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "fp4prep", "registry", "jobs")


@dataclass
class LightInstall:
    wheel: Path
    python: Path
    fp4prep: Path
    install_seconds: float


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LightInstall]:
    root = tmp_path_factory.mktemp("light")
    source = root / "source"  # a copy, so the build leaves nothing in the checkout
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(path, source / name)
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
                   check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("fp4prep-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    yield LightInstall(wheel, venv / "bin" / "python", venv / "bin" / "fp4prep", time.monotonic() - started)


def test_the_wheel_holds_the_code_and_nothing_else(light: LightInstall) -> None:
    names = zipfile.ZipFile(light.wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fp4prep", "registry", "jobs", light.wheel.name.split("-py")[0] + ".dist-info"}
    assert not [n for n in names if "tests" in n.split("/") or n.endswith((".safetensors", ".gguf", ".pyc"))]
    assert "fp4prep/client/core.py" in names and "fp4prep/cli/remote.py" in names
    metadata = zipfile.ZipFile(light.wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    hard = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert [line.split()[1] for line in hard] == ["requests<3,>=2.31"]


def test_the_light_install_has_neither_torch_nor_django_and_its_imports_need_neither(light: LightInstall) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('django') is None)"
    assert subprocess.run([str(light.python), "-c", probe], capture_output=True, text=True).stdout.split() == ["True", "True"]
    # And in the full install, importing the client and the command loads neither.
    loaded = "import sys, fp4prep.client, fp4prep.cli; print(sorted(m for m in ('torch', 'django') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, cwd=ROOT).stdout.strip() == "[]"


def test_commands_whose_extra_is_missing_say_what_to_install(light: LightInstall, tmp_path: Path) -> None:
    quantize = subprocess.run([str(light.fp4prep), "quantize", "--model-id", "some/model", "--output-directory", str(tmp_path / "out")],
                              capture_output=True, text=True)
    assert quantize.returncode == 2
    assert quantize.stderr.startswith("error: this command runs the pipeline, which needs torch, ")
    assert quantize.stderr.endswith(": pip install torch==2.13.0 && pip install 'fp4prep[pipeline]'\n")
    assert quantize.stderr.count("\n") == 1
    manage = subprocess.run([str(light.python), str(ROOT / "manage.py"), "check"], capture_output=True, text=True)
    assert (manage.returncode, manage.stderr) == (2, "error: manage.py runs the service, which needs Django: pip install 'fp4prep[service]'\n")


def test_the_light_client_and_command_drive_a_job_end_to_end(
    light: LightInstall, people: People, live_server: Any, catalogue: Any, tiny_adapter_archive: bytes,
    start_worker: Any, tmp_path: Path,
) -> None:
    archive = tmp_path / "adapter.tar.gz"
    archive.write_bytes(tiny_adapter_archive)
    env = env_for(live_server.url, people.alice.key)
    script = (
        "import sys; from fp4prep.client import Client; "
        f"print(Client().models.register_adapter(sys.argv[1], base_model={TINY_BASE_ID!r}, name='light').id)"
    )
    registered = subprocess.run([str(light.python), "-c", script, str(archive)], env=env, capture_output=True, text=True)
    assert registered.returncode == 0, registered.stderr
    model_id = registered.stdout.strip()
    start_worker("cpu")
    created = subprocess.run([str(light.fp4prep), "training", "fp4", "create", model_id, "-y", "--watch", "--interval", "0.3"],
                             env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert created.returncode == 0, created.stdout + created.stderr
    assert "Status: completed" in created.stdout
    prepared = created.stdout.splitlines()[-2].split()[1].rstrip(",")  # "Model ml_…, revision rv_…"
    out = tmp_path / "checkpoint"
    download = subprocess.run([str(light.fp4prep), "models", "download", prepared, "-o", str(out)], env=env,
                              capture_output=True, text=True)
    assert download.returncode == 0, download.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
