"""Jobs through the real HTTP API and a real django-q2 worker process, on a tiny model."""

from __future__ import annotations

import io
import json
import tarfile
from decimal import Decimal
from pathlib import Path
from typing import Any

from registry.models import Model

from ..helpers import People, error_of, ledger_of, wait_for


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
    assert (done["stage"], done["progress"]) == ("uploading", 1.0)
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

    import torch

    from fp4prep.pipeline import device
    from fp4prep.pipeline.validation import reader

    model = reader.load(out, device.resolve("cpu"))  # our independent reader dequantizes the downloaded files
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == config["vocab_size"] and torch.isfinite(logits).all()

    credit = alice.get("/v1/whoami").json()
    assert credit["held_usd"] == 0 and credit["balance_usd"] == 9.90  # charged once, hold settled
    assert people.charlie.get(f"/v1/models/{model_id}").status_code == 404
    assert error_of(people.charlie.get(f"/v1/post-training/prepare-for-fp4-inference/{job['id']}")) == (
        404, "job_not_found", f"Shaping job {job['id']} not found"
    )
    assert Decimal(str(done["estimate"]["price_usd"])) == Decimal("0.10")


def test_jobs_wait_for_a_free_slot_and_a_repeat_job_adds_a_revision_to_the_same_model(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:
    alice = people.alice
    first = alice.create(adapter_object_id=adapter["id"]).json()
    second = alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")  # one slot
    wait_for(lambda: alice.job(first["id"])["status"] == "running", what="first job running")
    assert alice.job(second["id"])["status"] == "pending"  # no free slot yet
    one, two = alice.wait(first["id"]), alice.wait(second["id"])
    assert one["status"] == two["status"] == "completed", alice.events(second["id"])
    assert one["results"]["api_model_object_id"] == two["results"]["api_model_object_id"]
    assert one["results"]["api_model_revision_id"] != two["results"]["api_model_revision_id"]
    revisions = alice.get(f"/v1/models/{one['results']['api_model_object_id']}/revisions").json()["data"]
    assert [r["id"] for r in revisions] == [two["results"]["api_model_revision_id"], one["results"]["api_model_revision_id"]]
    credit = alice.get("/v1/whoami").json()
    assert (credit["balance_usd"], credit["held_usd"]) == (9.8, 0.0)

    from jobs.tasks import prepare

    events_before = alice.events(first["id"])
    assert prepare(first["id"]) == "not claimed"  # the same task delivered again runs nothing
    assert alice.events(first["id"]) == events_before


def test_cancelling_a_pending_job_ends_it_and_releases_its_hold(people: People, adapter: dict[str, Any]) -> None:
    alice = people.alice
    job = alice.create(adapter_object_id=adapter["id"]).json()
    response = alice.cancel(job["id"])
    assert response.status_code == 200 and response.json()["status"] == "cancel_requested"
    done = alice.wait(job["id"], timeout=10)
    assert done["status"] == "cancelled"
    assert statuses(alice.events(job["id"])) == ["pending", "cancel_requested", "cancelled"]
    assert alice.get("/v1/whoami").json()["available_usd"] == 10.0
    assert error_of(alice.cancel(job["id"])) == (
        409, "job_not_cancellable", f"Shaping job {job['id']} is not cancellable: it has already ended (cancelled)"
    )


def test_cancelling_a_queued_job_ends_it_before_any_worker_runs_it(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:
    from django.utils import timezone

    from jobs.models import Worker

    alice = people.alice
    # A worker announced one free slot; its cluster hasn't taken the task from the queue yet.
    Worker.objects.create(name="announced", kind="cpu", slots=1, last_seen=timezone.now())
    job = alice.create(adapter_object_id=adapter["id"]).json()
    assert job["status"] == "pending"  # a new job starts pending, even when a slot takes it at once
    assert alice.job(job["id"])["status"] == "queued"
    assert alice.cancel(job["id"]).json()["status"] == "cancel_requested"
    assert alice.wait(job["id"], timeout=10)["status"] == "cancelled"
    Worker.objects.filter(name="announced").delete()
    start_worker("cpu")  # the real cluster now receives the queued task: its claim fails, nothing runs
    from django_q.models import Success

    wait_for(lambda: Success.objects.filter(name=f"prepare {job['id']}").exists(), what="the stale task to be consumed")
    assert Success.objects.get(name=f"prepare {job['id']}").result == "not claimed"
    assert statuses(alice.events(job["id"])) == ["pending", "queued", "cancel_requested", "cancelled"]


def test_cancelling_a_running_job_stops_the_run_at_its_next_check(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:
    alice = people.alice
    job = alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")
    wait_for(lambda: alice.job(job["id"])["stage"] in ("merging", "calibrating"), what="a stage to start")
    assert alice.cancel(job["id"]).json()["status"] == "cancel_requested"
    done = alice.wait(job["id"])
    events = alice.events(job["id"])
    assert done["status"] == "cancelled", [(e["type"], e["message"]) for e in events]
    assert statuses(events)[-2:] == ["cancel_requested", "cancelled"]
    assert events[-1]["message"].startswith("Job cancelled during")
    assert done["results"] is None and not Model.objects.filter(kind="prepared").exists()
    assert alice.get("/v1/whoami").json()["available_usd"] == 10.0


def job_on_a_worker_that_dies(people: People, adapter: dict[str, Any], start_worker: Any) -> dict[str, Any]:
    """A job that a worker named 'doomed' started running when the worker was killed."""
    job: dict[str, Any] = people.alice.create(adapter_object_id=adapter["id"]).json()
    doomed = start_worker("cpu", name="doomed")
    wait_for(lambda: people.alice.job(job["id"])["status"] == "running", what="the job to run")
    doomed.kill()
    return job


def test_a_job_whose_worker_dies_ends_error_with_its_hold_released(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:

    alice = people.alice
    job = job_on_a_worker_that_dies(people, adapter, start_worker)
    start_worker("gpu", name="survivor")  # any live worker's heartbeat runs the reaper
    done = alice.wait(job["id"], timeout=60)
    events = alice.events(job["id"])
    assert done["status"] == "error"
    assert events[-1]["type"] == "SHAPING_ERROR" and "stopped sending heartbeats" in events[-1]["message"]
    assert "doomed" in events[-1]["message"] and "Retrying may help" in events[-1]["message"]
    credit = alice.get("/v1/whoami").json()
    assert (credit["balance_usd"], credit["held_usd"]) == (10.0, 0.0)
    assert not Model.objects.filter(kind="prepared").exists()


def test_a_requeued_job_continues_from_the_last_layer_its_dead_worker_finished(
    people: People, catalogue: Any, start_worker: Any, tmp_path: Path, tokenizer_dir: Path
) -> None:
    from django.conf import settings

    from fp4prep.pipeline.inputs.adapter_files import base_weight_shapes
    from jobs import services
    from jobs.models import Job
    from tests.pipeline.bases import random_llama
    from tests.tiny import save_adapter

    # Deep enough that calibration takes seconds, so the worker dies in the middle of it.
    deep = random_llama(tmp_path / "deep", tokenizer_dir, layers=12, hidden=256, intermediate=1024)
    catalogue.weights_location = str(deep)
    catalogue.weight_shapes = base_weight_shapes(deep)
    catalogue.save()
    adapter_dir = save_adapter(deep, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.01)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(adapter_dir, arcname="deep-adapter")
    alice = people.alice
    adapter = alice.register_adapter(archive.getvalue()).json()
    job = alice.create(adapter_object_id=adapter["id"]).json()

    manifest = settings.ARTIFACT_ROOT / "work" / job["id"] / "state" / "calibration" / "manifest.json"
    doomed = start_worker("cpu", name="doomed")

    def layers_done() -> int:
        try:
            return int(json.loads(manifest.read_text())["last_completed_layer"]) + 1
        except (OSError, ValueError, KeyError):
            return 0

    wait_for(lambda: layers_done() >= 3, timeout=300, what="three calibrated layers", interval=0.01)
    doomed.kill()
    finished = layers_done()
    assert 3 <= finished < 12
    start_worker("cpu", name="survivor")
    assert alice.wait(job["id"], timeout=60)["status"] == "error"

    new = services.requeue(Job.objects.get(pk=job["id"]))  # support's requeue action
    assert not (settings.ARTIFACT_ROOT / "work" / job["id"]).exists()  # handed to the new job
    done = alice.wait(new.id)
    events = alice.events(new.id)
    assert done["status"] == "completed", [(e["type"], e["message"]) for e in events]
    messages = [e["message"] for e in events]
    assert f"Requeued from {job['id']} by support; it continues from where that job stopped" in messages
    assert f"Resuming calibration at layer {finished + 1} of 12: an earlier run finished layers 1-{finished}" in messages
    assert done["report"]["resumed_from_layer"] == finished
    assert not (settings.ARTIFACT_ROOT / "work" / new.id).exists()  # removed once the job ended
    assert ledger_of(job["id"]) == ["hold", "release"] and ledger_of(new.id) == ["hold", "charge"]
    assert Model.objects.get(kind="prepared").revisions.count() == 1


def test_a_cancellation_can_be_requested_once_and_a_dead_workers_job_then_ends_cancelled(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:
    alice = people.alice
    job = job_on_a_worker_that_dies(people, adapter, start_worker)
    assert alice.cancel(job["id"]).json()["status"] == "cancel_requested"
    assert error_of(alice.cancel(job["id"])) == (
        409, "job_not_cancellable",
        f"Shaping job {job['id']} is not cancellable: its cancellation was already requested; it stops at the worker's next check",
    )
    start_worker("gpu", name="survivor")
    assert alice.wait(job["id"], timeout=60)["status"] == "cancelled"
    assert "its worker" in alice.events(job["id"])[-1]["message"]
    assert alice.get("/v1/whoami").json()["available_usd"] == 10.0


def test_a_calibration_file_with_too_few_tokens_ends_user_error(
    people: People, adapter: dict[str, Any], start_worker: Any
) -> None:
    alice = people.alice
    small = alice.upload_file(
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 3
    ).json()
    assert small["status"] == "processed"  # estimate doesn't count tokens
    job = alice.create(adapter_object_id=adapter["id"], calibration_file_id=small["id"]).json()
    start_worker("cpu")
    done = alice.wait(job["id"])
    events = alice.events(job["id"])
    assert done["status"] == "user_error"
    assert events[-1]["type"] == "SHAPING_USER_ERROR" and "at least 256 are needed" in events[-1]["message"]
    assert alice.get("/v1/whoami").json()["held_usd"] == 0


def test_a_gpu_job_on_a_worker_without_the_weights_ends_error(
    people: People, shipped_catalogue: None, tiny_adapter_archive: bytes, start_worker: Any
) -> None:
    from registry.models import Project

    alice = people.alice
    Project.objects.get(pk=people.project_a.pk).add_credit(Decimal(50), "top-up")
    adapter = alice.register_adapter(tiny_adapter_archive, base_model="zai-org/GLM-5.3-FP8").json()
    job = alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")  # the wrong kind: the job stays pending
    from jobs.models import Worker

    # Two heartbeats of the CPU worker: a whole dispatch ran between them, and left the job alone.
    wait_for(lambda: Worker.objects.filter(kind="cpu").exists(), what="the CPU worker to announce itself")
    first = Worker.objects.get(kind="cpu").last_seen
    wait_for(lambda: Worker.objects.get(kind="cpu").last_seen > first, what="a second heartbeat")
    assert alice.job(job["id"])["status"] == "pending"
    start_worker("gpu")
    done = alice.wait(job["id"])
    events = alice.events(job["id"])
    assert done["status"] == "error"
    assert events[-1]["type"] == "SHAPING_ERROR"
    assert events[-1]["message"].startswith("This worker has no weights for GLM-5.3 (zai-org/GLM-5.3-FP8)")
    assert alice.get("/v1/whoami").json()["held_usd"] == 0


def test_a_job_whose_weights_are_not_stored_as_its_catalogue_entry_says_ends_error_before_any_work(
    people: People, adapter: dict[str, Any], catalogue: Any, start_worker: Any
) -> None:
    # The entry says the base is an MXFP4 release; the worker holds BF16 weights there.
    catalogue.weights_format = "mxfp4"
    catalogue.save()
    job = people.alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")
    assert people.alice.wait(job["id"])["status"] == "error"
    events = people.alice.events(job["id"])
    assert events[-1]["type"] == "SHAPING_ERROR"
    assert events[-1]["message"].startswith("This worker's weights for Tiny-Llama (")
    assert "are stored as bf16, but its catalogue entry says mxfp4." in events[-1]["message"]
    assert not any(e["data"].get("stage") == "merging" for e in events if e["type"] == "JOB_STAGE")
    assert people.alice.get("/v1/whoami").json()["held_usd"] == 0


def test_failures_on_our_side_tell_the_customer_without_internal_paths_or_exception_text(
    people: People, adapter: dict[str, Any], calibration: dict[str, Any], catalogue: Any, start_worker: Any
) -> None:
    from django.conf import settings

    from jobs.models import CalibrationFile

    alice = people.alice
    # The store lost a file (its exception names the absolute path), and a catalogue entry that
    # can't run: the exceptions stay in the worker's log.
    CalibrationFile.objects.get(pk=calibration["id"]).path.unlink()
    lost = alice.create(adapter_object_id=adapter["id"], calibration_file_id=calibration["id"]).json()
    # Saving such an entry is refused (test_catalogue.py); this one was edited around the model.
    type(catalogue).objects.filter(pk=catalogue.pk).update(run_settings={**catalogue.run_settings, "sequence_length": "long"})
    broken = alice.create(adapter_object_id=adapter["id"]).json()
    start_worker("cpu")
    for job in (lost, broken):
        assert alice.wait(job["id"])["status"] == "error"
        events = alice.events(job["id"])
        assert events[-1]["type"] == "SHAPING_ERROR"
        assert events[-1]["message"].startswith("Internal error during ")
        assert events[-1]["message"].endswith(
            f"; nothing was registered and the hold is released. Retrying may help; support can look it up under job {job['id']}."
        )
        for event in events:
            assert str(settings.ARTIFACT_ROOT) not in event["message"] and "Error" not in event["message"].split(":")[0]
    assert alice.get("/v1/whoami").json()["held_usd"] == 0


def test_paths_are_cut_from_messages_shown_to_customers() -> None:
    from jobs.worker import public

    assert public("calibration file /srv/fp4prep/artifacts/files/file-1.jsonl does not exist") == (
        "calibration file file-1.jsonl does not exist"
    )
    assert public("see https://docs.example.com/a/b, ratio 1/2 and a/b") == "see https://docs.example.com/a/b, ratio 1/2 and a/b"
