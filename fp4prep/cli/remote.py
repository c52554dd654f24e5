"""The commands that talk to an fp4prep server through the Python client (``fp4prep.client``):
``training fp4 estimate|create|get|list|list-events|cancel`` (as the seed's ``tg training fp4``),
``files``, ``models`` and ``whoami``. The key and server come from ``--api-key``/``--base-url`` or
FP4PREP_API_KEY/FP4PREP_BASE_URL.

Exit codes: 0 done; 1 our side (a 5xx, an unreachable server, a job that ended ``error``); 2 your
input (a 4xx, a calibration file that failed validation, a job that ended ``user_error``); 3 a
watched job was cancelled; 130 you stopped watching (the job goes on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from fp4prep.client import Client, Job
from fp4prep.client.errors import APIError, ConfigurationError, Fp4prepError

from . import output as out

EXIT_ERROR, EXIT_INPUT, EXIT_CANCELLED, EXIT_STOPPED = 1, 2, 3, 130
JOB_EXIT = {"completed": 0, "error": EXIT_ERROR, "user_error": EXIT_INPUT, "cancelled": EXIT_CANCELLED}


class Refused(Exception):
    """A clear one-line reason the command stops, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_INPUT) -> None:
        super().__init__(message)
        self.code = code


def client_of(args: argparse.Namespace) -> Client:
    if not (args.api_key or os.environ.get("FP4PREP_API_KEY")):
        raise Refused("no API key: pass --api-key or set FP4PREP_API_KEY (create one on the dashboard's API keys page)")
    return Client(api_key=args.api_key, base_url=args.base_url)


def run(handler: Any, args: argparse.Namespace) -> int:
    """Every API command goes through here: errors become one line on stderr and an exit code."""
    try:
        return int(handler(client_of(args), args) or 0)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except APIError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_INPUT if exc.status < 500 else EXIT_ERROR
    except ConfigurationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_INPUT
    except Fp4prepError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_ERROR


# --- training fp4 -----------------------------------------------------------------------------------


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


def _print_report(filename: str, report: Any) -> None:
    print(f"{filename} did not pass validation ({report.error_count} error{'s' if report.error_count != 1 else ''}):", file=sys.stderr)
    for error in report.errors:
        print(f"  line {error.line}: {error.message}", file=sys.stderr)
    if report.error_count > len(report.errors):
        print(f"  ... and {report.error_count - len(report.errors)} more", file=sys.stderr)


def _upload_calibration(client: Client, path: Path, quiet: bool = False) -> str:
    uploaded = client.files.upload(path, purpose="calibration")
    if uploaded.status != "processed":
        _print_report(path.name, uploaded.report)
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
        from fp4prep.pipeline.conversations import validate

        with path.open("rb") as stream:
            report = validate(stream)
        if not report.ok:
            _print_report(path.name, report)
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
            return EXIT_ERROR
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
            if job.status != status:
                status = job.status
                print(f"Status: {status}", flush=True)
            for event in events:
                print(f"  {out.when(event.created_at)}  {event.type:<18}  {event.message}", flush=True)
                after = event.id
            if job.is_terminal:
                break
            if job.status == "running":
                bar.update(job.stage, job.progress)
            time.sleep(interval)
    except KeyboardInterrupt:
        bar.close()
        print(f"\nStopped watching; the job goes on. Resume with: fp4prep training fp4 get {job_id} --watch", file=sys.stderr)
        return EXIT_STOPPED
    bar.close()
    if job.results:
        print(f"Model {job.results.api_model_object_id}, revision {job.results.api_model_revision_id}")
        print(f"Download it with: fp4prep models download {job.results.api_model_object_id} --revision {job.results.api_model_revision_id}")
    elif job.status == "user_error":
        print("The job failed because of its input: the SHAPING_USER_ERROR event above says what to fix.", file=sys.stderr)
    elif job.status == "error":
        print("The job failed on our side: retry, or contact support if it fails again.", file=sys.stderr)
    return JOB_EXIT[job.status]


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
    _more(page)
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
        return EXIT_ERROR
    job = client.post_training.prepare_for_fp4_inference.cancel(args.job_id)
    if args.json:
        out.dump(job.raw)
        return 0
    print(f"Cancellation requested for {job.id} ({job.status}); it reaches cancelled once the run stops.")
    print(f"Confirm with: fp4prep training fp4 get {job.id} --watch")
    return 0


# --- files, models, whoami --------------------------------------------------------------------------


def _more(page: Any) -> None:
    if page.next:
        print(f"(page {page.page} of {-(-page.total // page.page_size)}; --page {page.page + 1} for more)")


def cmd_files_upload(client: Client, args: argparse.Namespace) -> int:
    uploaded = client.files.upload(args.path, purpose=args.purpose)
    if args.json:
        out.dump(uploaded.raw)
    elif uploaded.status == "processed":
        print(f"Uploaded {uploaded.filename} as {uploaded.id}: processed, {uploaded.report.conversations} conversations.")
    else:
        _print_report(uploaded.filename, uploaded.report)
        print(f"Kept as {uploaded.id} with its report; no job accepts it.", file=sys.stderr)
    return 0 if uploaded.status == "processed" else EXIT_INPUT


def cmd_files_list(client: Client, args: argparse.Namespace) -> int:
    page = client.files.list(page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    if not page.data:
        print("No files yet. Upload one with: fp4prep files upload FILE.jsonl")
        return 0
    rows = [[f.id, f.filename, f.status, f.report.conversations, f.report.error_count, out.size(f.size_bytes), out.when(f.created_at)] for f in page.data]
    print(out.table(["ID", "FILENAME", "STATUS", "CONVERSATIONS", "ERRORS", "SIZE", "UPLOADED"], rows))
    _more(page)
    return 0


def cmd_files_get(client: Client, args: argparse.Namespace) -> int:
    f = client.files.retrieve(args.file_id)
    if args.json:
        out.dump(f.raw)
        return 0
    print(out.facts([("File", f.id), ("Filename", f.filename), ("Status", f.status), ("Conversations", f.report.conversations),
                     ("Size", out.size(f.size_bytes)), ("SHA-256", f.sha256), ("Uploaded", out.when(f.created_at))]))
    if f.status != "processed":
        _print_report(f.filename, f.report)
    return 0


def cmd_models_list(client: Client, args: argparse.Namespace) -> int:
    page = client.models.list(kind=args.kind, page=args.page)
    if args.json:
        out.dump(page.raw)
        return 0
    rows = [[m.id, m.kind, m.name, m.base_model, m.latest_revision.id if m.latest_revision else ""] for m in page.data]
    print(out.table(["ID", "KIND", "NAME", "BASE", "LATEST REVISION"], rows))
    _more(page)
    return 0


def cmd_models_get(client: Client, args: argparse.Namespace) -> int:
    model = client.models.retrieve(args.model_id)
    if args.json:
        out.dump(model.raw)
        return 0
    rows: list[tuple[str, Any]] = [("Model", model.id), ("Kind", model.kind), ("Name", model.name), ("Base", model.base_model)]
    if model.source_adapter_id:
        rows.append(("From adapter", model.source_adapter_id))
    print(out.facts(rows))
    revisions = client.models.revisions(model.id)
    print()
    print(out.table(["REVISION", "#", "SIZE", "FILES", "CREATED"],
                    [[r.id, r.number, out.size(r.size_bytes), len(r.files), out.when(r.created_at)] for r in revisions.data]))
    return 0


def cmd_models_configs(client: Client, args: argparse.Namespace) -> int:
    profiles = client.models.configs(args.model_id)
    if args.json:
        out.dump({"data": [p.raw for p in profiles]})
        return 0
    if not profiles:
        print(f"No deployment profiles for {args.model_id}.")
        return 0
    print(out.table(["CONFIG", "NAME", "HARDWARE", "GPUS", "QUANTIZATION"],
                    [[p.id, p.name, p.hardware, p.gpu_count, p.quantization] for p in profiles]))
    return 0


def cmd_models_download(client: Client, args: argparse.Namespace) -> int:
    revision_id = args.revision
    if not revision_id:
        latest = client.models.retrieve(args.model_id).latest_revision
        if latest is None:
            raise Refused(f"model {args.model_id} has no revisions to download")
        revision_id = latest.id
    target = Path(args.output or f"{args.model_id}-{revision_id}")
    if target.exists() and any(target.iterdir()):
        raise Refused(f"{target} exists and is not empty; pass --output with a new directory")
    bar: Any = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, file=sys.stderr, desc="download")

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total or None
            bar.update(done - bar.n)

    try:
        client.models.download(args.model_id, revision_id, target, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    files = sorted(p for p in target.rglob("*") if p.is_file())
    print(f"Downloaded {args.model_id} revision {revision_id} to {target}/ ({len(files)} files, {out.size(sum(p.stat().st_size for p in files))}).")
    return 0


def cmd_whoami(client: Client, args: argparse.Namespace) -> int:
    project = client.whoami()
    if args.json:
        out.dump(project.raw)
        return 0
    print(out.facts([("Project", project.id), ("Name", project.name), ("Blocked", "yes" if project.blocked else "no"),
                     ("Balance", out.usd(project.balance_usd)), ("Held", out.usd(project.held_usd)),
                     ("Available", out.usd(project.available_usd)), ("Server", client.base_url)]))
    return 0


# --- the parser -------------------------------------------------------------------------------------


def add_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-key", default=None, help="default: $FP4PREP_API_KEY")
    common.add_argument("--base-url", default=None, help="default: $FP4PREP_BASE_URL, else http://127.0.0.1:8000")
    reads = argparse.ArgumentParser(add_help=False, parents=[common])
    reads.add_argument("--json", action="store_true", help="print the API's JSON")

    def command(group: Any, name: str, handler: Any, help: str, read: bool = True) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = group.add_parser(name, help=help, parents=[reads if read else common])
        parser.set_defaults(func=lambda args: run(handler, args))
        return parser

    training = sub.add_parser("training", help="jobs on the server").add_subparsers(dest="group", required=True)
    fp4 = training.add_parser("fp4", help="prepare adapters for FP4 inference").add_subparsers(dest="verb", required=True)
    for name, handler, help in (
        ("estimate", cmd_estimate, "price and running time of a job; creates nothing"),
        ("create", cmd_create, "start a job (asks to confirm in a terminal)"),
    ):
        p = command(fp4, name, handler, help)
        p.add_argument("model_id", metavar="ML", help="the adapter's model ID (ml_...)")
        p.add_argument("--adapter-revision-id", metavar="RV", help="default: the adapter's latest revision")
        p.add_argument("--calibration-file", "-c", metavar="FILE_OR_ID", help="a local JSONL file (uploaded) or a file ID")
        if name == "create":
            p.add_argument("--confirm", "-y", action="store_true", help="don't ask")
            p.add_argument("--watch", action="store_true", help="then watch the job until it ends")
            p.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default 5)")
    p = command(fp4, "get", cmd_get, "a job; --watch follows it until it ends")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--watch", action="store_true", help="print each status change and new event until the job ends")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default 5)")
    p = command(fp4, "list", cmd_list, "the project's jobs, newest first")
    p.add_argument("--status", help="only these statuses (comma-separated)")
    p.add_argument("--page", type=int)
    p = command(fp4, "list-events", cmd_list_events, "a job's events, oldest first")
    p.add_argument("job_id", metavar="JOB")
    p = command(fp4, "cancel", cmd_cancel, "request cancellation (asks to confirm in a terminal)")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--force", "-y", action="store_true", help="don't ask")

    files = sub.add_parser("files", help="calibration files").add_subparsers(dest="verb", required=True)
    p = command(files, "upload", cmd_files_upload, "upload and validate a JSONL file")
    p.add_argument("path", type=Path)
    p.add_argument("--purpose", default="calibration")
    p = command(files, "list", cmd_files_list, "the project's files")
    p.add_argument("--page", type=int)
    p = command(files, "get", cmd_files_get, "a file and its validation report")
    p.add_argument("file_id", metavar="FILE")

    models = sub.add_parser("models", help="the model registry").add_subparsers(dest="verb", required=True)
    p = command(models, "list", cmd_models_list, "the project's models and the public bases")
    p.add_argument("--kind", choices=["base", "adapter", "merged", "full", "prepared"])
    p.add_argument("--page", type=int)
    p = command(models, "get", cmd_models_get, "a model and its revisions")
    p.add_argument("model_id", metavar="ML")
    p = command(models, "configs", cmd_models_configs, "deployment profiles of a model")
    p.add_argument("model_id", metavar="ML")
    p = command(models, "download", cmd_models_download, "download and unpack a revision", read=False)
    p.add_argument("model_id", metavar="ML")
    p.add_argument("--revision", metavar="RV", help="default: the latest")
    p.add_argument("--output", "-o", metavar="DIR", help="default: ./ML-RV")

    command(sub, "whoami", cmd_whoami, "the API key's project and its credit")
