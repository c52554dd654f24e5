"""Jobs through the real HTTP API and a real django-q2 worker process, on a tiny model."""

from __future__ import annotations

import io
import json
import tarfile
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..conftest import People, error_of


def statuses(events: list[dict[str, Any]]) -> list[str]:
    return [e["data"]["status"] for e in events if e["data"] and "status" in e["data"]]


def test_a_job_runs_to_completed_and_its_revision_downloads_and_loads(
    people: People, adapter: dict[str, Any], calibration: dict[str, Any], start_worker: Any, tmp_path: Path
) -> None:
    alice = people.alice
    inputs = {"adapter_object_id": adapter["id"], "calibration_file_id": calibration["id"]}
    estimate = alice.estimate(**inputs).json()
    assert estimate["price_usd"] == 0.10 and estimate["allowed_to_proceed"] is True

    created = alice.create(**inputs)
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["id"].startswith("shp-quant-") and job["status"] == "pending"
    assert job["inputs"]["adapter_revision_id"] == adapter["latest_revision"]["id"]  # latest by default
    assert people.alice.get("/v1/whoami").json()["held_usd"] == 0.10

    start_worker("cpu")
    done = alice.wait(job["id"])
    events = alice.events(job["id"])
    assert done["status"] == "completed", [(e["type"], e["message"]) for e in events]
    assert statuses(events) == ["pending", "queued", "running", "completed"]
    stages = [e["data"]["stage"] for e in events if e["type"] == "JOB_STAGE"]
    assert stages == ["merging", "calibrating", "quantizing", "exporting", "validating", "uploading"]
    assert done["report"]["parity"]["prompts"] == 3 and done["report"]["corpus"]["user_tokens"] > 0

    model_id, revision_id = done["results"]["api_model_object_id"], done["results"]["api_model_revision_id"]
    model = alice.get(f"/v1/models/{model_id}").json()
    assert model["kind"] == "prepared" and model["base_model"] == "tests/tiny-llama-nvfp4"
    assert model["latest_revision"]["id"] == revision_id

    download = alice.get(f"/v1/models/{model_id}/revisions/{revision_id}/download")
    assert download.status_code == 200
    assert int(download.headers["Content-Length"]) == len(download.content)
    out = tmp_path / "checkpoint"
    with tarfile.open(fileobj=io.BytesIO(download.content)) as tar:
        tar.extractall(out, filter="data")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    lineage = json.loads((out / "fp4prep.json").read_text())
    assert lineage["job"] == job["id"] and lineage["adapter"].startswith(adapter["id"])

    from fp4prep.pipeline import reader

    import torch

    model = reader.load(out)  # our independent reader dequantizes the downloaded files
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == config["vocab_size"] and torch.isfinite(logits).all()

    credit = alice.get("/v1/whoami").json()
    assert credit["held_usd"] == 0 and credit["balance_usd"] == 9.90  # charged once, hold settled
    assert people.charlie.get(f"/v1/models/{model_id}").status_code == 404
    assert error_of(people.charlie.get(f"/v1/post-training/prepare-for-fp4-inference/{job['id']}")) == (
        404, "job_not_found", f"Shaping job {job['id']} not found"
    )
    assert Decimal(str(done["estimate"]["price_usd"])) == Decimal("0.10")
