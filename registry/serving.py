"""The exact commands to fetch a revision and serve it, shown on the revision page."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from fp4prep.pipeline import serving
from fp4prep.pipeline.validation.report import serving_note

from .models import DeploymentProfile, Model, Revision

# vLLM's --quantization method for each checkpoint layout we write (docs/pipeline.md, "What the checkpoint holds").
VLLM_METHOD = {"nvfp4": "modelopt_fp4", "mxfp4": "compressed-tensors", "fp8": "modelopt"}


@dataclass(frozen=True)
class ServeCommand:
    profile: DeploymentProfile | None
    download: str
    serve: str
    note: str = ""


def quantization_of(revision: Revision) -> str:
    return str(revision.metadata.get("quantization") or "")


def commands(model: Model, revision: Revision, api_root: str) -> list[ServeCommand]:
    """One download and one ``vllm serve`` per deployment profile (tensor parallel = its GPUs).

    Adapters and other unquantized revisions get none: they are served through their base.
    """
    quantization = quantization_of(revision)
    if model.kind != Model.Kind.PREPARED or quantization not in VLLM_METHOD:
        return []
    directory = f"{model.id}-{revision.id}"
    url = f"{api_root.rstrip('/')}/v1/models/{model.id}/revisions/{revision.id}/download"
    download = (
        f'curl -fL -H "Authorization: Bearer $FP4PREP_API_KEY" \\\n    {shlex.quote(url)} \\\n    -o {directory}.tar\n'
        f"mkdir -p {directory} && tar -xf {directory}.tar -C {directory}"
    )
    profiles: list[DeploymentProfile | None] = list(model.deployment_profiles()) or [None]
    report = revision.metadata.get("report") or {}
    commands = []
    for profile in profiles:
        flags = [
            f"vllm serve ./{directory}",
            f"--quantization {VLLM_METHOD[quantization]}",
            f"--tensor-parallel-size {profile.gpu_count if profile else 1}",
            f"--served-model-name {shlex.quote(model.name)}",
        ]
        note, flag = _differs(quantization, profile, report)
        commands.append(ServeCommand(profile, download, " \\\n    ".join(flags + ([flag] if flag else [])), note))
    return commands


def _differs(quantization: str, profile: DeploymentProfile | None, report: dict) -> tuple[str, str]:
    """What serving on this profile computes other than the checkpoint declares, with the figures
    the job measured there, and the flag that runs it as declared where those missed the bar."""
    numerics = serving.numerics_on(quantization, profile.hardware) if profile else None
    if numerics is None or profile is None:
        return "", ""
    measured = serving_note(report, profile.hardware)
    if not measured:
        return f"{numerics.description}; this revision's job did not measure it that way.", ""
    missed = any(profile.hardware in s["hardware"] and s["misses"] for s in report.get("serving", []))
    if not missed or not numerics.as_declared_flag:
        return f"On {profile.hardware}: {measured}.", ""
    return f"On {profile.hardware}: {measured} ({numerics.as_declared_effect}).", numerics.as_declared_flag
