"""The pipeline tests' fixtures: tiny bases and a calibration file in the test's own directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny import save_tiny_base, write_conversations


@pytest.fixture
def make_base(tmp_path: Path, tokenizer_dir: Path) -> Callable[..., Path]:
    def make(arch: str = "llama", name: str = "base", seed: int = 0) -> Path:
        return save_tiny_base(tmp_path / name, arch, tokenizer_dir, seed)

    return make


@pytest.fixture
def llama_base(make_base: Callable[..., Path]) -> Path:
    return make_base("llama")


@pytest.fixture
def calibration_file(tmp_path: Path) -> Path:
    return write_conversations(tmp_path / "calibration.jsonl", 120)
