"""Benchmark: the API under polling load, on the production setup (gunicorn, PostgreSQL, Redis).

Fills a fresh PostgreSQL database with ``--jobs`` jobs (five events each) spread over one project
per client, starts gunicorn, then runs ``--clients`` clients for ``--seconds``: each has its own API
key and, every ``--interval`` seconds, polls one of its jobs and that job's new events, and every
fifth time its jobs list, as the CLI's --watch and the dashboard do. Prints, per endpoint, the
requests made, errors, and p50/p95/p99 latency seen by the clients. The database is dropped at
the end.

    .venv/bin/python benchmarks/load_api.py [--clients 50] [--seconds 60] [--jobs 10000] [--interval 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOBS = "/v1/post-training/prepare-for-fp4-inference"
ENDPOINTS = ("job detail", "job events", "jobs list")

SEED = """
import os, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fp4prep.site.settings")
django.setup()
import json, random, sys
from datetime import timedelta
from decimal import Decimal
from django.utils import timezone
from jobs.models import Job, JobEvent
from registry.models import ApiKey, Model, Revision, SupportedBase
from registry.services import create_project

clients, jobs = int(sys.argv[1]), int(sys.argv[2])
base = SupportedBase.objects.get(slug="smollm2-135m-instruct")
random.seed(0)
out = []
now = timezone.now()
statuses = ["completed"] * 7 + ["error", "cancelled", "user_error"]
for c in range(clients):
    project, key = create_project(f"load {c}", Decimal(100))
    adapter = Model.objects.create(project=project, kind="adapter", name=f"bot {c}", base_model=base.accepted_base_ids[0], supported_base=base)
    revision = Revision.objects.create(model=adapter, number=1, path="x", size_bytes=1, sha256="0" * 64)
    rows = []
    for j in range(jobs // clients):
        created = now - timedelta(minutes=j)
        rows.append(Job(project=project, adapter=adapter, adapter_revision=revision, supported_base=base,
                        status=random.choice(statuses), stage="uploading", progress=1.0, price_usd=Decimal("0.10"),
                        time_hours=Decimal("0.05"), created_at=created, started_at=created, finished_at=created,
                        report={"parity": {"top1_agreement": 0.61, "mean_kl": 0.99}}))
    made = Job.objects.bulk_create(rows)
    events = []
    for job in made:
        for i, (kind, message) in enumerate([("JOB_STATUS", "Job created"), ("JOB_STATUS", "Job is queued"),
                                             ("JOB_STATUS", "Job is running"), ("JOB_STAGE", "Merging"),
                                             ("JOB_STATUS", "Job " + job.status)]):
            events.append(JobEvent(job=job, type=kind, message=message, data={"status": job.status}, created_at=job.created_at + timedelta(seconds=i)))
    JobEvent.objects.bulk_create(events, batch_size=5000)
    out.append({"key": key, "jobs": [j.id for j in made]})
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client(index: int, base_url: str, key: str, jobs: list[str], seconds: float, interval: float, results: Any) -> None:
    import requests

    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    rng = random.Random(index)
    seen: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
    errors = dict.fromkeys(ENDPOINTS, 0)
    watched, after, polls = rng.choice(jobs), 0, 0
    deadline = time.monotonic() + seconds
    time.sleep(rng.random() * interval)  # clients don't start in step
    while time.monotonic() < deadline:
        tick = time.monotonic()
        calls = [("job detail", f"{JOBS}/{watched}", {}), ("job events", f"{JOBS}/{watched}/events", {"after": after} if after else {})]
        if polls % 5 == 0:
            calls.append(("jobs list", JOBS, {"page": rng.randint(1, 5)}))
        for name, path, params in calls:
            started = time.perf_counter()
            try:
                response = session.get(base_url + path, params=params, timeout=30)
                ok = response.status_code == 200
                if ok and name == "job events" and response.json()["data"]:
                    after = response.json()["data"][-1]["id"]
            except requests.RequestException:
                ok = False
            seen[name].append((time.perf_counter() - started) * 1000)
            errors[name] += not ok
        polls += 1
        if polls % 20 == 0:
            watched, after = rng.choice(jobs), 0  # the user moves on to another job
        time.sleep(max(0.0, interval - (time.monotonic() - tick)))
    results.put((seen, errors))


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between one client's polls (0: as fast as it can)")
    parser.add_argument("--workers", type=int, default=2 * (os.cpu_count() or 1) + 1, help="gunicorn processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per gunicorn process")
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432", help="server URL (a database is created on it)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args()

    import psycopg

    name = f"fp4prep_load_{os.getpid()}"
    with psycopg.connect(f"{args.postgres}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    tmp = Path(tempfile.mkdtemp(prefix="fp4prep-load-"))
    env = {
        **os.environ,
        "DATABASE_URL": f"{args.postgres}/{name}",
        "FP4PREP_BROKER_URL": args.redis,
        "FP4PREP_SECRET_KEY": "load-benchmark-" + "x" * 40,
        "FP4PREP_VAR_DIR": str(tmp),
        "FP4PREP_DB_CONN_MAX_AGE": "60",
        "FP4PREP_LOG_LEVEL": "WARNING",
    }
    server = None
    try:
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run([*manage, "migrate", "-v0"], env=env, cwd=ROOT, check=True)
        subprocess.run([*manage, "collectstatic", "--noinput", "-v0"], env=env, cwd=ROOT, check=True)
        started = time.perf_counter()
        seeded = subprocess.run([sys.executable, "-c", SEED, str(args.clients), str(args.jobs)], env=env, cwd=ROOT,
                                check=True, capture_output=True, text=True)
        clients = json.loads(seeded.stdout.strip().splitlines()[-1])
        print(f"seeded {sum(len(c['jobs']) for c in clients):,} jobs with 5 events each in {len(clients)} projects "
              f"in {time.perf_counter() - started:.0f} s")
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "fp4prep.site.wsgi", "-b", f"127.0.0.1:{port}", "-w", str(args.workers),
             "-k", "gthread", "--threads", str(args.threads), "--log-level", "warning"],
            env=env, cwd=ROOT, start_new_session=True,
        )
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, clients[0]["key"])
        print(f"gunicorn: {args.workers} processes x {args.threads} threads on {os.cpu_count()} CPUs; "
              f"{args.clients} clients polling every {args.interval:g} s for {args.seconds:g} s")
        results: Any = multiprocessing.Queue()
        procs = [
            multiprocessing.Process(target=client, args=(i, base_url, c["key"], c["jobs"], args.seconds, args.interval, results))
            for i, c in enumerate(clients)
        ]
        for p in procs:
            p.start()
        gathered = [results.get() for _ in procs]
        for p in procs:
            p.join()
        report(gathered, args.seconds)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        with psycopg.connect(f"{args.postgres}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def wait_ready(base_url: str, key: str) -> None:
    import requests

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(base_url + "/v1/whoami", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    sys.exit("gunicorn did not answer within 60 s")


def report(gathered: list[Any], seconds: float) -> None:
    print("\n| endpoint | requests | errors | req/s | p50 ms | p95 ms | p99 ms |\n|---|---|---|---|---|---|---|")
    everything: list[float] = []
    total_errors = 0
    for name in ENDPOINTS:
        values = [v for seen, _ in gathered for v in seen[name]]
        errors = sum(e[name] for _, e in gathered)
        everything += values
        total_errors += errors
        print(f"| {name} | {len(values):,} | {errors} | {len(values) / seconds:.0f} | {percentile(values, 50):.1f} | "
              f"{percentile(values, 95):.1f} | {percentile(values, 99):.1f} |")
    print(f"| all | {len(everything):,} | {total_errors} | {len(everything) / seconds:.0f} | {percentile(everything, 50):.1f} | "
          f"{percentile(everything, 95):.1f} | {percentile(everything, 99):.1f} |")
    print(f"\nmean {statistics.mean(everything):.1f} ms; goal p95 <= 50 ms and no errors: "
          + ("met" if percentile(everything, 95) <= 50 and total_errors == 0 else "NOT met"))


if __name__ == "__main__":
    main()
