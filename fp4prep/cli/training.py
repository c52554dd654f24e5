"""``fp4prep training fp4 estimate|create|get|list|list-events|cancel``: FP4 preparation jobs on a
server, the shape of other providers' ``training`` CLIs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from fp4prep.client import Client, Job

from . import exits
from . import output as out
from .connection import Refused, check_size, more, print_report


def _inputs(args: argparse.Namespace, calibration_file_id: str | None) -> dict[str, Any]:
    inputs: dict[str, Any] = {"adapter_object_id": args.model_id}
    if args.adapter_revision_id:
        inputs["adapter_revision_id"] = args.adapter_revision_id
    if calibration_file_id:
        inputs["calibration_file_id"] = calibration_file_id
    return inputs


def _local_file(value: str | None) -> Path | None:
    if not value:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path
    if value.startswith("file-"):
        return None
    raise Refused(f"--calibration-file {value}: no such local file, and not a calibration file ID (file-...)")






def _upload_calibration(client: Client, path: Path, quiet: bool = False) -> str:
    check_size(client, path)
    uploaded = client.files.upload(path, purpose="calibration")
    if uploaded.status != "processed":
        print_report(path.name, uploaded.report)
        raise Refused(f"calibration file {uploaded.id} failed validation; fix the lines above and retry")
    if not quiet:
        print(f"Uploaded {path.name} as {uploaded.id} ({uploaded.report.conversations} conversations).")
    return uploaded.id


def _print_estimate(estimate: Any) -> None:
    print(
        f"The estimated price of this job is {out.usd(estimate.price_usd)} and it is expected to run for about "
        f"{out.hours(estimate.time_hours)} (excluding queue time)."
    )
    if not estimate.allowed_to_proceed:
        print(f"Warning: {estimate.reason}", file=sys.stderr)


def cmd_estimate(client: Client, args: argparse.Namespace) -> int:
    path = _local_file(args.calibration_file)
    file_id = None if path else args.calibration_file
    if path:  # checked here with the server's own rules; create uploads it
        from fp4prep.pipeline.inputs.conversations import validate

        check_size(client, path)
        with path.open("rb") as stream:
            report = validate(stream)
        if not report.ok:
            print_report(path.name, report)
            raise Refused(f"{path} failed validation; fix the lines above")
        if not args.json:
            print(f"{path.name} passed validation ({report.conversations} conversations); create uploads it.")
    estimate = client.post_training.prepare_for_fp4_inference.estimate_cost(inputs=_inputs(args, file_id))
    if args.json:
        out.dump(estimate.raw)
    else:
        _print_estimate(estimate)
    return 0


def cmd_create(client: Client, args: argparse.Namespace) -> int:
    api = client.post_training.prepare_for_fp4_inference
    path = _local_file(args.calibration_file)
    file_id = _upload_calibration(client, path, quiet=args.json) if path else args.calibration_file
    inputs = _inputs(args, file_id)
    if not args.confirm and out.interactive():
        estimate = api.estimate_cost(inputs=inputs)
        _print_estimate(estimate)
        if not estimate.allowed_to_proceed:
            raise Refused(f"not created: {estimate.reason}")
        if not out.confirm(f"Create this job for {out.usd(estimate.price_usd)}?"):
            print("Not created.")
            return exits.ERROR
    job = api.create(inputs=inputs)
    if args.json and not args.watch:
        out.dump(job.raw)
        return 0
    print(f"Created job {job.id} ({job.status}). Follow it with: fp4prep training fp4 get {job.id} --watch")
    return watch(client, job.id, args.interval) if args.watch else 0


def _stage_bar(job: Job, width: int = 24) -> str:
    filled = round(job.progress * width)
    eta = f", about {round(job.eta_seconds)} s left" if job.eta_seconds else ""
    return f"{job.stage} [{'#' * filled}{'.' * (width - filled)}] {job.progress:.0%}{eta}"


def _print_job(job: Job) -> None:
    rows: list[tuple[str, Any]] = [("Job", job.id), ("Status", job.status)]
    if job.status in ("running", "cancel_requested") and job.stage:
        rows.append(("Stage", _stage_bar(job)))
    if job.inputs:
        rows.append(("Adapter", f"{job.inputs.adapter_object_id} revision {job.inputs.adapter_revision_id}"))
        rows.append(("Calibration", job.inputs.calibration_file_id or "general text only"))
    rows += [
        ("Result format", f"{job.quantization.upper()} on {job.base_model}"),
        ("Price", out.usd(job.estimate.get("price_usd", 0))),
        ("Created", out.when(job.created_at)),
    ]
    if job.finished_at:
        rows.append(("Finished", out.when(job.finished_at)))
    if job.results:
        rows += [("Model", job.results.api_model_object_id), ("Revision", job.results.api_model_revision_id)]
    print(out.facts(rows))


def cmd_get(client: Client, args: argparse.Namespace) -> int:
    if args.watch:
        return watch(client, args.job_id, args.interval)
    job = client.post_training.prepare_for_fp4_inference.retrieve(args.job_id)
    if args.json:
        out.dump(job.raw)
    else:
        _print_job(job)
    return 0


def watch(client: Client, job_id: str, interval: float) -> int:
    """Prints each status change and new event until the job ends; stopping it leaves the job running."""
    api = client.post_training.prepare_for_fp4_inference
    bar = out.StageBar()
    status, after = "", None
    try:
        while True:
            job = api.retrieve(job_id)
            events = api.list_events(job_id, after=after).data  # after the job: a terminal job's events are all here
            if job.status != status or events:
                bar.close()
            # A job that ended: its last events (registering, the result) come before the ending.
            if job.status != status and not job.is_terminal:
                status = job.status
                print(f"Status: {status}", flush=True)
            for event in events:
                print(f"  {out.when(event.created_at)}  {event.type:<18}  {event.message}", flush=True)
                after = event.id
            if job.is_terminal:
                if job.status != status:
                    print(f"Status: {job.status}", flush=True)
                break
            if job.status == "running":
                bar.update(job.stage, job.progress)
            time.sleep(interval)
    except KeyboardInterrupt:
        bar.close()
        print(f"\nStopped watching; the job goes on. Resume with: fp4prep training fp4 get {job_id} --watch", file=sys.stderr)
        return exits.STOPPED
    bar.close()
    if job.results:
        print(f"Model {job.results.api_model_object_id}, revision {job.results.api_model_revision_id}")
        print(f"Download it with: fp4prep models download {job.results.api_model_object_id} --revision {job.results.api_model_revision_id}")
    elif job.status == "user_error":
        print("The job failed because of its input: the SHAPING_USER_ERROR event above says what to fix.", file=sys.stderr)
    elif job.status == "error":
        print("The job failed on our side: retry, or contact support if it fails again.", file=sys.stderr)
    return exits.JOB_EXIT[job.status]


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    page = client.post_training.prepare_for_fp4_inference.list(status=args.status, page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    if not page.data:
        print("No FP4 preparation jobs" + (f" with status {args.status}." if args.status else " yet."))
        return 0
    rows = [[j.id, j.status, j.stage if j.status == "running" else "", f"{j.base_model} {j.quantization.upper()}",
             out.usd(j.estimate.get("price_usd", 0)), out.when(j.created_at)] for j in page.data]
    print(out.table(["ID", "STATUS", "STAGE", "FORMAT", "PRICE", "CREATED"], rows))
    more(page)
    return 0


def cmd_list_events(client: Client, args: argparse.Namespace) -> int:
    events = client.post_training.prepare_for_fp4_inference.list_events(args.job_id)
    if args.json:
        out.dump(events.raw)
        return 0
    print(out.table(["TIME", "TYPE", "MESSAGE"], [[out.when(e.created_at), e.type, e.message] for e in events.data]))
    return 0


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    if not args.force and out.interactive() and not out.confirm(f"Cancel job {args.job_id}?"):
        print("Not cancelled.")
        return exits.ERROR
    job = client.post_training.prepare_for_fp4_inference.cancel(args.job_id)
    if args.json:
        out.dump(job.raw)
        return 0
    print(f"Cancellation requested for {job.id} ({job.status}); it reaches cancelled once the run stops.")
    print(f"Confirm with: fp4prep training fp4 get {job.id} --watch")
    return 0
