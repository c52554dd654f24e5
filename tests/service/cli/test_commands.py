"""``fp4prep training fp4 | files | models | whoami`` against a live server and a real worker."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

from fp4prep.text import format_bytes
from jobs.models import Job
from registry.models import Revision

from .helpers import Cli

ESTIMATE = "The estimated price of this job is $0.10 and it is expected to run for about 0.05h (excluding queue time).\n"
BAD = b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'


def one_line_error(result: Any, code: int, message: str) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert result.stderr == f"error: {message}\n"


def test_estimate_prints_the_seeds_sentence_and_warns_when_credit_cannot_cover_it(
    cli: Cli, people: Any, adapter: dict[str, Any], calibration_bytes: bytes, tmp_path: Path
) -> None:
    result = cli("training", "fp4", "estimate", adapter["id"], "--adapter-revision-id", adapter["latest_revision"]["id"])
    assert (result.returncode, result.stdout, result.stderr) == (0, ESTIMATE, "")

    good = tmp_path / "calibration.jsonl"
    good.write_bytes(calibration_bytes)
    result = cli("training", "fp4", "estimate", adapter["id"], "-c", str(good))
    assert result.returncode == 0
    assert result.stdout == "calibration.jsonl passed validation (120 conversations); create uploads it.\n" + ESTIMATE
    assert not people.project_a.files.exists()  # estimate creates nothing

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(BAD)
    result = cli("training", "fp4", "estimate", adapter["id"], "-c", str(bad))
    assert result.returncode == 2
    assert "bad.jsonl did not pass validation (1 error):\n  line 2: not valid JSON" in result.stderr
    one_line_error(cli("training", "fp4", "estimate", adapter["id"], "-c", "nope.jsonl"), 2,
                   "--calibration-file nope.jsonl: no such local file, and not a calibration file ID (file-...)")

    people.project_a.add_credit(Decimal("-9.95"), "test: leave $0.05")
    result = cli("training", "fp4", "estimate", adapter["id"])
    assert result.returncode == 0 and result.stdout == ESTIMATE
    assert result.stderr == (
        "Warning: The estimated price $0.10 exceeds the project's available credit $0.05 "
        "(balance $0.05, $0.00 held by other jobs). Add credits and retry.\n"
    )
    body = json.loads(cli("training", "fp4", "estimate", adapter["id"], "--json").stdout)
    assert body["allowed_to_proceed"] is False and body["price_usd"] == 0.1


def test_create_without_a_terminal_starts_at_once_and_watch_follows_it_to_completed(
    cli: Cli, people: Any, adapter: dict[str, Any], calibration_bytes: bytes, start_worker: Any, tmp_path: Path
) -> None:
    start_worker("cpu")
    data = tmp_path / "support-chats.jsonl"
    data.write_bytes(calibration_bytes)
    result = cli("training", "fp4", "create", adapter["id"], "-c", str(data), "--watch", "--interval", "0.3")
    assert result.returncode == 0, result.stderr
    job = Job.objects.get(project=people.project_a)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Uploaded support-chats.jsonl as file-") and lines[0].endswith("(120 conversations).")
    # queued at once when the worker's slot is free
    assert lines[1] == f"Created job {job.id} (pending). Follow it with: fp4prep training fp4 get {job.id} --watch"
    statuses = [line for line in lines if line.startswith("Status: ")]
    assert statuses[-1] == "Status: completed" and "Status: running" in statuses
    # The ending comes after the events that led to it.
    assert result.stdout.index("Job completed") < result.stdout.index("Status: completed")
    for message in ("Merging the adapter", "Calibrating on the corpus", "Quantizing", "Exporting", "Validating", "Job completed"):
        assert message in result.stdout
    job.refresh_from_db()
    assert lines[-2] == f"Model {job.result_model_id}, revision {job.result_revision_id}"
    assert job.calibration_file is not None and job.calibration_file.filename == "support-chats.jsonl"

    # Watching again after the end prints the whole story once more and the same exit code.
    again = cli("training", "fp4", "get", job.id, "--watch", "--interval", "0.3")
    assert again.returncode == 0 and again.stdout.count("Status: ") == 1 and "Job completed" in again.stdout

    got = cli("training", "fp4", "get", job.id)
    assert got.returncode == 0 and f"Model          {job.result_model_id}" in got.stdout
    assert json.loads(cli("training", "fp4", "get", job.id, "--json").stdout)["results"]["api_model_revision_id"] == job.result_revision_id
    listed = cli("training", "fp4", "list").stdout.splitlines()
    assert listed[0].split() == ["ID", "STATUS", "STAGE", "FORMAT", "PRICE", "CREATED"] and listed[2].startswith(f"{job.id}  completed")
    events = cli("training", "fp4", "list-events", job.id).stdout
    assert events.splitlines()[0].split() == ["TIME", "TYPE", "MESSAGE"] and "JOB_STAGE" in events

    out = tmp_path / "checkpoint"
    download = cli("models", "download", job.result_model_id, "-o", str(out))
    assert download.returncode == 0, download.stderr
    revision = Revision.objects.get(pk=job.result_revision_id)
    assert download.stdout.startswith(f"Downloaded {job.result_model_id} revision {revision.id} to {out}/ ({len(revision.files)} files")
    import hashlib

    for f in revision.files:
        assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    one_line_error(cli("models", "download", job.result_model_id, "-o", str(out)), 2,
                   f"{out} exists and is not empty; pass --output with a new directory")

    models = cli("models", "list", "--kind", "prepared").stdout
    assert job.result_model_id in models and adapter["id"] not in models
    model = cli("models", "get", job.result_model_id).stdout
    assert f"From adapter  {adapter['id']}" in model and revision.id in model
    assert cli("models", "configs", job.result_model_id).stdout == f"No deployment profiles for {job.result_model_id}.\n"
    files = cli("files", "list").stdout
    assert "support-chats.jsonl" in files and "processed" in files
    assert "Conversations  120" in cli("files", "get", job.calibration_file_id).stdout
    whoami = cli("whoami").stdout
    assert f"Project    {people.project_a.id}" in whoami and "Available  $9.90" in whoami
    assert json.loads(cli("whoami", "--json").stdout)["available_usd"] == 9.9


def test_watch_exits_non_zero_when_the_job_fails_and_says_why(
    cli: Cli, people: Any, adapter: dict[str, Any], start_worker: Any
) -> None:
    small = people.alice.upload_file(
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 3
    ).json()
    start_worker("cpu")
    result = cli("training", "fp4", "create", adapter["id"], "-c", small["id"], "-y", "--watch", "--interval", "0.3")
    assert result.returncode == 2
    assert "Status: user_error" in result.stdout and "SHAPING_USER_ERROR" in result.stdout
    assert "at least 256 are needed" in result.stdout
    assert result.stderr == "The job failed because of its input: the SHAPING_USER_ERROR event above says what to fix.\n"


def test_uploading_a_bad_calibration_file_lists_its_errors(cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(BAD + b'{"messages": [{"role": "robot", "content": "x"}]}\n')
    result = cli("files", "upload", str(bad))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "bad.jsonl did not pass validation (2 errors):"
    assert lines[1].startswith("  line 2: not valid JSON") and lines[2].startswith("  line 3: messages[0].role must be one of")
    assert lines[3].startswith("Kept as file-") and lines[3].endswith("with its report; no job accepts it.")


def test_every_api_error_reaches_the_user_as_one_clear_line(cli: Cli, people: Any, adapter: dict[str, Any]) -> None:
    one_line_error(cli("training", "fp4", "estimate", "ml_nope"), 2, "model ml_nope does not exist in this project")
    one_line_error(cli("training", "fp4", "estimate", adapter["id"], key=people.charlie.key), 2,
                   f"model {adapter['id']} does not exist in this project")
    one_line_error(cli("training", "fp4", "get", "shp-quant-nope"), 2, "Shaping job shp-quant-nope not found")
    one_line_error(cli("files", "get", "file-nope"), 2, "Calibration file file-nope not found")
    one_line_error(cli("training", "fp4", "create", adapter["id"], "-c", "file-nope", "-y"), 2, "Calibration file file-nope not found")
    wrong_key = cli("whoami", key="fp4_wrong")
    assert wrong_key.returncode == 2 and wrong_key.stderr.startswith("error: ") and wrong_key.stderr.count("\n") == 1
    one_line_error(cli("whoami", key=None), 2,
                   "no API key: pass --api-key or set FP4PREP_API_KEY (create one on the dashboard's API keys page)")
    one_line_error(cli("whoami", FP4PREP_BASE_URL="http://127.0.0.1:9"), 1, "could not reach http://127.0.0.1:9: connection refused")

    people.project_a.block("unpaid invoice")
    one_line_error(cli("training", "fp4", "create", adapter["id"], "-y"), 2,
                   f"Project {people.project_a.id} is blocked from starting jobs (unpaid invoice). Contact support.")
    people.project_a.unblock()
    people.project_a.add_credit(Decimal("-9.95"), "test: leave $0.05")
    one_line_error(cli("training", "fp4", "create", adapter["id"], "-y"), 2,
                   "The estimated price $0.10 exceeds the project's available credit $0.05 "
                   "(balance $0.05, $0.00 held by other jobs). Add credits and retry.")
    assert not Job.objects.exists()


def test_a_calibration_file_over_the_servers_limit_is_refused_before_it_is_sent(
    cli: Cli, people: Any, adapter: dict[str, Any], calibration_bytes: bytes, tmp_path: Path, settings: Any
) -> None:
    settings.CALIBRATION_MAX_BYTES = 1024  # the live server reads the same settings
    big = tmp_path / "big.jsonl"
    big.write_bytes(calibration_bytes)
    refusal = f"--calibration-file {big}: {format_bytes(len(calibration_bytes))} is over the server's limit of 1 KiB for a calibration file; use fewer conversations"
    one_line_error(cli("training", "fp4", "estimate", adapter["id"], "-c", str(big)), 2, refusal)
    one_line_error(cli("training", "fp4", "create", adapter["id"], "-c", str(big), "-y"), 2, refusal)
    one_line_error(cli("files", "upload", str(big)), 2, refusal)
    assert not people.project_a.files.exists() and not Job.objects.exists()


def test_a_read_key_made_with_keys_create_lists_and_fetches_and_may_not_spend(
    cli: Cli, people: Any, adapter: dict[str, Any], calibration_bytes: bytes, tmp_path: Path
) -> None:
    made = cli("keys", "create", "--name", "monitoring", "--scope", "read")
    assert made.returncode == 0 and made.stdout.startswith("fp4_")
    assert "(monitoring, scope read). It is shown only this once" in made.stderr
    read_key = made.stdout.strip()
    listed = cli("keys", "list")
    assert "monitoring" in listed.stdout and " read " in listed.stdout and " full " in listed.stdout

    assert "Key scope  read\n" in cli("whoami", key=read_key).stdout
    assert cli("models", "get", adapter["id"], key=read_key).returncode == 0
    assert cli("training", "fp4", "list", key=read_key).returncode == 0
    denied = f"API key {read_key[:12]}… has the read scope: it lists and fetches, and may not POST here; use a key of the full scope"
    good = tmp_path / "calibration.jsonl"
    good.write_bytes(calibration_bytes)
    for args in (("files", "upload", str(good)), ("training", "fp4", "create", adapter["id"], "-y"),
                 ("keys", "create", "--scope", "full")):
        result = cli(*args, key=read_key)
        assert result.returncode == 2 and result.stderr.endswith(f"{denied}\n"), (args, result.stderr)
    assert not people.project_a.files.exists() and not Job.objects.exists()
    # The keys made before scopes existed stay full; the one made here is the only read key.
    assert sorted(people.project_a.api_keys.values_list("scope", flat=True)) == ["full", "full", "read"]
