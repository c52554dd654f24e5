"""The ``fp4prep`` command in a real subprocess: exit codes, summary, errors a user can act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .tiny import save_adapter, save_tiny_base, write_conversations


def fp4prep(
    *args: str, env: dict[str, str] | None = None, timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fp4prep.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def quantize(tiny: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    """``fp4prep quantize`` on the tiny base into the tiny output directory."""
    return fp4prep("quantize", "--model-id", str(tiny["base"]), "--output-directory", str(tiny["out"]), *args)


@pytest.fixture
def tiny(tmp_path: Path, tokenizer_dir: Path) -> dict[str, Path]:
    base = save_tiny_base(tmp_path / "base", "llama", tokenizer_dir)
    return {
        "base": base,
        "adapter": save_adapter(base, tmp_path / "adapter", targets=["q_proj", "v_proj"]),
        "calibration": write_conversations(tmp_path / "calibration.jsonl", 120),
        "out": tmp_path / "out",
    }


def test_a_bad_adapter_exits_2_with_a_one_line_error(tiny: dict[str, Path]) -> None:
    (tiny["adapter"] / "adapter_config.json").unlink()
    done = quantize(tiny, "--adapter-directory", str(tiny["adapter"]), "--quantization", "nvfp4", "--quiet")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tiny['adapter']} is not a PEFT adapter: adapter_config.json is missing"
    )
    assert not tiny["out"].exists()


def test_too_little_calibration_data_exits_2_and_says_how_much_is_needed(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    small = write_conversations(tmp_path / "small.jsonl", 6)
    done = quantize(
        tiny, "--quantization", "mxfp4", "-c", str(small), "--user-token-minimum", "4096", "--quiet"
    )
    assert done.returncode == 2
    assert "at least 4,096 are needed" in done.stderr


def test_a_checkpoint_below_the_recipes_bar_exits_1_and_writes_nothing(tiny: dict[str, Path]) -> None:
    # A random tiny model's greedy continuations diverge under FP4: the recipe's bar refuses it.
    done = quantize(
        tiny,
        "--adapter-directory",
        str(tiny["adapter"]),
        "-c",
        str(tiny["calibration"]),
        "--calibration-tokens",
        "2048",
    )
    assert done.returncode == 1, done.stderr
    assert "error: the checkpoint missed its quality thresholds" in done.stderr
    for stage in ("merging", "calibrating", "quantizing", "exporting", "validating"):
        assert stage in done.stderr  # one progress bar per stage
    assert not tiny["out"].exists()


def test_help_names_the_seed_flags() -> None:
    done = fp4prep("quantize", "--help")
    assert done.returncode == 0
    for flag in (
        "--model-id",
        "--adapter-directory",
        "--quantization",
        "--output-directory",
        "--calibration-file",
    ):
        assert flag in done.stdout


def test_the_demo_takes_any_of_its_adapters_and_refuses_others() -> None:
    done = fp4prep("demo", "--help")
    assert done.returncode == 0 and "--task" in done.stdout and "orders" in done.stdout
    refused = fp4prep("demo", "--task", "poetry")
    assert refused.returncode == 2
    assert "invalid choice: 'poetry'" in refused.stderr and "sentiment" in refused.stderr


def test_an_fp4_release_as_the_model_id_is_prepared_in_its_own_format(tiny: dict[str, Path], tmp_path: Path) -> None:
    # An MXFP4 release, made as the user made one: the tiny base quantized by the command.
    release = tmp_path / "release"
    made = fp4prep("quantize", "--model-id", str(tiny["base"]), "--output-directory", str(release),
                   "--quantization", "mxfp4", "--no-quality-gate", "--quiet")
    assert made.returncode == 0, made.stderr
    import json

    # No --quantization: the release's own format. The adapter was trained on the dense weights.
    done = fp4prep("quantize", "--model-id", str(release), "--adapter-directory", str(tiny["adapter"]),
                   "--output-directory", str(tiny["out"]), "--no-quality-gate", "--quiet", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["quantization"] == "mxfp4"
    # q_proj and v_proj of each layer re-coded, every other tensor copied from the release.
    layers = json.loads((release / "config.json").read_text())["num_hidden_layers"]
    assert result["release"]["requantized"] == 2 * layers and result["release"]["copied"] > 0
    assert json.loads((tiny["out"] / "config.json").read_text())["quantization_config"] == json.loads(
        (release / "config.json").read_text()
    )["quantization_config"]
    refused = fp4prep("quantize", "--model-id", str(release), "--adapter-directory", str(tiny["adapter"]),
                      "--output-directory", str(tmp_path / "other"), "--quantization", "nvfp4", "--quiet")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: the base is MXFP4 release (compressed-tensors): a model prepared from it keeps the release's "
        "format, so ask for mxfp4, not nvfp4"
    )
