"""The exact commands to fetch a revision and serve it, shown on the revision page."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .models import DeploymentProfile, Model, Revision

# vLLM's --quantization method for each checkpoint layout we write (README, "What the checkpoint holds").
VLLM_METHOD = {"nvfp4": "modelopt_fp4", "mxfp4": "compressed-tensors", "fp8": "modelopt"}
# GPUs on which vLLM 0.33 runs an MXFP4 checkpoint W4A4 (FlashInfer, compute capability 10+),
# quantizing the activations its weights-only config leaves out.
BLACKWELL = ("blackwell", "b100", "b200", "b300", "gb200", "gb300")
MXFP4_ON_BLACKWELL = (
    "On Blackwell GPUs vLLM 0.33 quantizes this checkpoint's activations to MXFP4 as well (W4A4, "
    "FlashInfer); its parity with BF16 above was measured with BF16 activations, as Hopper GPUs run it."
)


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
    return [
        ServeCommand(
            profile,
            download,
            " \\\n    ".join(
                [
                    f"vllm serve ./{directory}",
                    f"--quantization {VLLM_METHOD[quantization]}",
                    f"--tensor-parallel-size {profile.gpu_count if profile else 1}",
                    f"--served-model-name {shlex.quote(model.name)}",
                ]
            ),
            _note(quantization, profile),
        )
        for profile in profiles
    ]


def _note(quantization: str, profile: DeploymentProfile | None) -> str:
    """What serving on this profile runs differently from what the revision's parity measured."""
    hardware = (profile.hardware if profile else "").lower()
    if quantization == "mxfp4" and any(marker in hardware for marker in BLACKWELL):
        return MXFP4_ON_BLACKWELL
    return ""
