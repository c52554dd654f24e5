"""The OpenAPI schema matches the code; settings come from the environment and misconfiguration is caught."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, **(env or {})},
    )


def api_paths() -> set[str]:
    """Every /v1/ route the URLconf serves, in OpenAPI's {param} form."""
    found = set()

    def walk(patterns: list[Any], prefix: str) -> None:
        for p in patterns:
            route = prefix + str(p.pattern)
            if isinstance(p, URLResolver):
                walk(p.url_patterns, route)
            elif isinstance(p, URLPattern) and route.startswith("v1/") and route not in ("v1/schema", "v1/docs"):
                found.add("/" + route.replace("<str:", "{").replace(">", "}"))

    walk(get_resolver().url_patterns, "")
    return found


def test_the_schema_is_served_and_lists_every_endpoint(live_server: Any) -> None:
    response = requests.get(live_server.url + "/v1/schema", headers={"Accept": "application/json"}, timeout=30)
    assert response.status_code == 200
    schema = json.loads(response.content) if response.headers["Content-Type"].startswith("application/json") else None
    if schema is None:
        import yaml  # drf-spectacular depends on PyYAML

        schema = yaml.safe_load(response.content)
    assert set(schema["paths"]) == api_paths()
    job = schema["components"]["schemas"]["JobDetail"]["properties"]
    assert {"status", "stage", "progress", "eta_seconds", "results", "report"} <= set(job)
    # Every query parameter a view reads (``query_params.get("...")``) is in the schema.
    read = {
        name for path in [*(ROOT / "jobs").glob("*.py"), *(ROOT / "registry").glob("*.py")]
        for name in re.findall(r"query_params\.get\(\"(\w+)\"", path.read_text())
    }
    declared = {
        p["name"] for item in schema["paths"].values() for operation in item.values() if isinstance(operation, dict)
        for p in operation.get("parameters", []) if p["in"] == "query"
    }
    assert read == {"status", "after", "kind"} and read <= declared


def test_the_schema_generates_without_warnings() -> None:
    result = manage("spectacular", "--validate", "--fail-on-warn", "--file", os.devnull)
    assert result.returncode == 0, result.stderr


def test_the_web_process_never_imports_torch() -> None:
    code = (
        "import django, sys; django.setup(); "
        "from django.urls import get_resolver; get_resolver().url_patterns; "
        "from django.core.management import call_command; call_command('check'); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env={**os.environ, "DJANGO_SETTINGS_MODULE": "fp4prep.site.settings"})
    assert result.stdout.strip().splitlines()[-1] == "False False", result.stderr


PRODUCTION = {
    "FP4PREP_HTTPS": "1",
    "FP4PREP_SECRET_KEY": "k" * 30 + "-production-secret-with-plenty-of-entropy-0123456789",
    "FP4PREP_ALLOWED_HOSTS": "fp4prep.example.com",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/postgres",
    "FP4PREP_BROKER_URL": "redis://127.0.0.1:6379/0",
}


def test_check_deploy_is_clean_when_configured_for_production(tmp_path: Path) -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", env={**PRODUCTION, "FP4PREP_ARTIFACT_ROOT": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_debug_is_off_and_the_secret_key_is_this_installations_own_unless_set(tmp_path: Path) -> None:
    show = "from django.conf import settings; print(settings.DEBUG, settings.SECRET_KEY)"
    env = {"FP4PREP_VAR_DIR": str(tmp_path), "FP4PREP_DEBUG": "0", "FP4PREP_SECRET_KEY": ""}
    first = manage("shell", "-c", show, env={k: v for k, v in env.items() if k != "FP4PREP_DEBUG"})
    second = manage("shell", "-c", show, env=env)
    debug, key = first.stdout.splitlines()[-1].split()
    assert debug == "False" and len(key) >= 50 and second.stdout == first.stdout, first.stderr
    assert (tmp_path / "secret_key").read_text() == key and (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
    other = manage("shell", "-c", show, env={**env, "FP4PREP_VAR_DIR": str(tmp_path / "elsewhere")})
    assert other.stdout.splitlines()[-1].split()[1] != key
    assert manage("shell", "-c", show, env={**env, "FP4PREP_DEBUG": "1"}).stdout.splitlines()[-1].startswith("True ")


def test_error_reports_hide_the_database_and_broker_urls() -> None:
    from django.test import override_settings
    from django.views.debug import get_default_exception_reporter_filter

    secret = "s3cr3t-pw"
    with override_settings(
        Q_CLUSTER={"redis": f"redis://:{secret}@cache:6379/0"}, DATABASE_URL=f"postgres://u:{secret}@db/x",
        BROKER_URL=f"redis://:{secret}@cache:6379/0",
    ):
        get_default_exception_reporter_filter.cache_clear()
        shown = repr(get_default_exception_reporter_filter().get_safe_settings())
    assert secret not in shown and "DATABASE_URL" in shown


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FP4PREP_DEBUG": "maybe"}, "FP4PREP_DEBUG='maybe' is not a boolean"),
        ({"FP4PREP_WORKER_KIND": "tpu"}, "FP4PREP_WORKER_KIND='tpu' must be one of cpu, gpu"),
        ({"FP4PREP_WORKER_SLOTS": "0"}, "FP4PREP_WORKER_SLOTS=0 is below its minimum of 1"),
        ({"FP4PREP_WORKER_DEVICE": "tpu"}, "FP4PREP_WORKER_DEVICE='tpu' must be auto, cpu, cuda or cuda:N"),
        ({"FP4PREP_RESUME_KEEP_HOURS": "-1"}, "FP4PREP_RESUME_KEEP_HOURS"),
        ({"FP4PREP_WORKER_SLOTS": "two"}, "FP4PREP_WORKER_SLOTS='two' is not a whole number"),
        ({"FP4PREP_BROKER_URL": "amqp://localhost"}, "must be a redis:// URL"),
        ({"DATABASE_URL": "nosuchdb://x"}, "DATABASE_URL="),
    ],
)
def test_bad_settings_stop_start_up_naming_the_variable(env: dict[str, str], message: str) -> None:
    result = manage("check", env=env)
    assert result.returncode != 0 and "ImproperlyConfigured" in result.stderr and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("env", "check_id"),
    [
        ({"FP4PREP_HEARTBEAT_INTERVAL": "60", "FP4PREP_HEARTBEAT_TIMEOUT": "90"}, "fp4prep.E002"),
        ({**PRODUCTION, "DATABASE_URL": ""}, "fp4prep.W001"),
        ({**PRODUCTION, "FP4PREP_BROKER_URL": ""}, "fp4prep.W002"),
        ({**PRODUCTION, "FP4PREP_SECRET_KEY": ""}, "fp4prep.W003"),
        ({"FP4PREP_ARTIFACT_ROOT": "{tmp}/a-file/artifacts"}, "fp4prep.E001"),
    ],
)
def test_system_checks_catch_settings_that_cannot_work(env: dict[str, str], check_id: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    result = manage("check", "--deploy", "--fail-level", "WARNING", env={"FP4PREP_VAR_DIR": str(tmp_path), **env})
    assert result.returncode != 0 and check_id in result.stdout + result.stderr, result.stdout + result.stderr


def test_env_helpers_raise_on_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4prep.site import env

    monkeypatch.setenv("X_FLOAT", "fast")
    with pytest.raises(ImproperlyConfigured, match="X_FLOAT='fast' is not a number"):
        env.env_float("X_FLOAT", 1.0)
    monkeypatch.setenv("X_LIST", "a, b,,c")
    assert env.env_list("X_LIST", []) == ["a", "b", "c"]


def test_createproject_prints_the_project_and_a_working_key(transactional_db: Any, live_server: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("createproject", "Acme", "--credit", "25.50", stdout=out)
    created = json.loads(out.getvalue())
    assert created["project_id"].startswith("proj_") and created["api_key"].startswith("fp4_")
    me = requests.get(live_server.url + "/v1/whoami", headers={"Authorization": f"Bearer {created['api_key']}"}, timeout=30).json()
    assert me == {
        "id": created["project_id"], "name": "Acme", "key_scope": "full", "blocked": False, "balance_usd": 25.5, "held_usd": 0.0, "available_usd": 25.5,
        "limits": {"calibration_file_bytes": settings.CALIBRATION_MAX_BYTES, "adapter_archive_bytes": settings.ADAPTER_MAX_BYTES},
    }


def test_createproject_refuses_a_bad_amount(transactional_db: Any) -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--credit 'lots' is not an amount in USD"):
        call_command("createproject", "Acme", "--credit", "lots")


def test_migrations_match_the_models() -> None:
    result = manage("makemigrations", "--check", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
