"""The versions of the tools a checkpoint was made with."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed


def version(package: str) -> str | None:
    try:
        return installed(package)
    except PackageNotFoundError:
        return None


def tool_versions() -> dict[str, str | None]:
    import fp4prep

    return {
        "fp4prep": fp4prep.__version__,
        **{p: version(p) for p in ("nvidia-modelopt", "torch", "transformers", "peft", "safetensors")},
    }
