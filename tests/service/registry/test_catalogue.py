"""The shipped catalogue and the checks that keep an edited entry runnable."""

from __future__ import annotations

import ast
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from registry.models import DeploymentProfile, Model, SupportedBase

from ..helpers import ROOT, TINY_RUN_SETTINGS


def test_the_shipped_entries_are_valid_and_priced_as_the_spec_says(shipped_catalogue: None) -> None:
    entries = {b.slug: b for b in SupportedBase.objects.all()}
    assert set(entries) == {"glm-5.3", "kimi-k3", "smollm2-135m-instruct"}
    for entry in entries.values():
        entry.full_clean()
    assert SupportedBase.for_base_id("zai-org/GLM-5.3-NVFP4") == entries["glm-5.3"]
    assert entries["glm-5.3"].served_base_id == "zai-org/GLM-5.3-NVFP4" and entries["glm-5.3"].quantization == "nvfp4"
    assert entries["kimi-k3"].quantization == "mxfp4" and entries["kimi-k3"].worker_kind == "gpu"
    assert entries["glm-5.3"].user_token_minimum == entries["kimi-k3"].user_token_minimum == 598016
    assert entries["smollm2-135m-instruct"].user_token_minimum == 4096 and entries["smollm2-135m-instruct"].worker_kind == "cpu"
    assert DeploymentProfile.objects.get(pk="cr_Cf3yApYdaWMrH6RsyVmh7").supported_base_id == "glm-5.3"
    assert DeploymentProfile.objects.get(pk="cr_CfsRY8rFVfgH9cEWwywEa").supported_base_id == "kimi-k3"
    assert Model.objects.filter(project__isnull=True, kind="base").count() == 4


@pytest.mark.parametrize(
    ("run_settings", "message"),
    [
        ({"calibration_token": 10}, "run_settings.calibration_token: not a setting a catalogue entry fixes"),
        ({"sequence_length": "long"}, "run_settings.sequence_length: must be a whole number, not 'long'"),
        ({"calibration_tokens": 0}, "run_settings.calibration_tokens: must be at least 1, not 0"),
        ({"holdout_fraction": 1.5}, "run_settings.holdout_fraction: must be between 0.0 and 1.0, not 1.5"),
        ({"thresholds": {"answer_kl": 1.0}}, "run_settings.thresholds: must be an object with exactly the keys"),
        ({"thresholds": {**TINY_RUN_SETTINGS["thresholds"], "answer_kl": "low"}},
         "run_settings.thresholds.answer_kl: must be a finite number, not 'low'"),
        ([], "run_settings: must be a JSON object, not list"),
    ],
)
def test_an_entry_with_run_settings_the_pipeline_cannot_run_is_refused_wherever_it_is_saved(
    catalogue: Any, run_settings: Any, message: str
) -> None:
    pattern = re.escape(message)
    catalogue.run_settings = run_settings
    with pytest.raises(ValidationError, match=pattern):  # the admin's form
        catalogue.full_clean()
    with pytest.raises(ValidationError, match=pattern):  # any save: the catalogue command, a script
        catalogue.save()
    catalogue.refresh_from_db()
    assert catalogue.run_settings == TINY_RUN_SETTINGS


def test_every_setting_an_entry_fixes_is_a_field_of_the_pipelines_config() -> None:
    from dataclasses import fields

    from fp4prep.pipeline.config import PipelineConfig, RunSettings

    config_fields = {f.name: f.type for f in fields(PipelineConfig)}
    for setting in fields(RunSettings):
        assert setting.name in config_fields
        assert config_fields[setting.name] in (setting.type, setting.type.replace(" | None", ""))
    parsed = RunSettings.parse(TINY_RUN_SETTINGS)
    config = PipelineConfig(base_dir=Path("base"), output_dir=Path("out"), **parsed.config_fields())
    assert (config.calibration_tokens, config.sequence_length, config.thresholds) == (2048, 128, parsed.thresholds)


def manage(*args: str, database: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{database}", "DJANGO_SETTINGS_MODULE": "fp4prep.site.settings"}
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_new_database_migrated_holds_the_shipped_catalogue_and_the_command_keeps_it(tmp_path: Path) -> None:
    database = tmp_path / "new.sqlite3"
    assert manage("migrate", "-v0", database=database).returncode == 0
    checked = manage("catalogue", "--check", database=database)
    assert (checked.returncode, checked.stdout.strip()) == (0, "The catalogue is as shipped.")
    # An entry edited since (as support staff might): the check names it, the command puts it back.
    connection = sqlite3.connect(database)
    with connection:
        connection.execute("UPDATE registry_supportedbase SET typical_hours = 7 WHERE slug = 'glm-5.3'")
    checked = manage("catalogue", "--check", database=database)
    assert checked.returncode == 1 and checked.stdout.strip() == "would change glm-5.3: sets typical_hours"
    applied = manage("catalogue", database=database)
    assert (applied.returncode, applied.stdout.strip()) == (0, "glm-5.3: sets typical_hours")
    assert manage("catalogue", "--check", database=database).returncode == 0
    connection.close()


def test_the_catalogue_command_refuses_an_entry_that_cannot_run_naming_it_and_the_field(
    monkeypatch: pytest.MonkeyPatch, catalogue: Any
) -> None:
    from django.core.management import CommandError, call_command

    from registry import catalogue as shipped

    broken = [{**shipped.CATALOGUE[0], "run_settings": {"sequence_length": 0}}]
    monkeypatch.setattr(shipped, "CATALOGUE", broken)
    with pytest.raises(CommandError, match=r"catalogue entry glm-5\.3: .*run_settings\.sequence_length: must be at least 1, not 0"):
        call_command("catalogue")
    assert not SupportedBase.objects.filter(slug="glm-5.3").exists()


# Migrations import Django and the standard library only: what one installs never changes when the
# code changes. The first migrations name the ID functions their models use as field defaults (Django
# records a callable default by its import path; the schema does not depend on it).
MIGRATION_IMPORTS = {"django", "decimal", "secrets", "string"}
FIELD_DEFAULTS = {"fp4prep.site.ids"}


def test_migrations_hold_their_rows_and_import_no_live_code() -> None:
    for path in sorted([*(ROOT / "registry" / "migrations").glob("0*.py"), *(ROOT / "jobs" / "migrations").glob("0*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                allowed = name.split(".")[0] in MIGRATION_IMPORTS or (name in FIELD_DEFAULTS and path.name == "0001_initial.py")
                assert allowed, f"{path.relative_to(ROOT)} imports {name}"
