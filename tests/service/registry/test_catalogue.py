"""The shipped catalogue and the checks that keep an edited entry runnable."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

from registry.models import DeploymentProfile, Model, SupportedBase


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
        ({"calibration_token": 10}, "unknown keys ['calibration_token']"),
        ({"thresholds": {"answer_kl": 1.0}}, "thresholds must be an object with exactly the keys"),
        ([], "must be a JSON object"),
    ],
)
def test_an_entry_with_run_settings_the_pipeline_cannot_run_is_refused(catalogue: Any, run_settings: Any, message: str) -> None:
    catalogue.run_settings = run_settings
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        catalogue.full_clean()
