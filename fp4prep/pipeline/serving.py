"""What the serving engine computes depends on the GPU it runs on, not only on the checkpoint.

vLLM 0.33 reads an MXFP4 checkpoint (compressed-tensors ``mxfp4-pack-quantized``) into its W4A4
scheme whatever the config says about activations: on Blackwell GPUs (compute capability 10 and
up: B200, GB200, RTX PRO 6000 Blackwell, ...) FlashInfer's kernel quantizes every quantized layer's
input to MXFP4 as well (``CutlassExpertsMxfp4`` does the same for routed experts), while on Hopper
and older GPUs Marlin runs it weights-only, with BF16 inputs. NVFP4 and FP8 checkpoints run as they
declare on every GPU that serves them.

So a run is told the hardware its base is deployed on, and measures its checkpoint once more in
each numerics other than the declared one (``EngineNumerics``), as the engine will run it there.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hardware names that mean compute capability 10 or 12 (Blackwell), lower case.
BLACKWELL = ("blackwell", "b100", "b200", "b300", "gb200", "gb300", "rtx pro 6000", "rtx 5090", "rtx 5080", "gb10")


@dataclass(frozen=True)
class EngineNumerics:
    key: str
    # What the engine does differently from what the checkpoint declares, for people.
    description: str
    # vLLM's setting that makes it run the checkpoint as declared instead, where there is one, and
    # what that setting leaves as it was.
    as_declared_flag: str = ""
    as_declared_effect: str = ""


MXFP4_W4A4 = EngineNumerics(
    "mxfp4-w4a4",
    "vLLM 0.33 on Blackwell quantizes every quantized layer's input to MXFP4 too (W4A4, FlashInfer)",
    """--kernel-config '{"linear_backend_per_quant": {"mxfp4": "marlin"}}'""",
    # vLLM 0.33 picks CutlassExpertsMxfp4 for MXFP4 routed experts on Blackwell whatever the
    # linear backend: no weights-only MoE kernel there.
    "Marlin runs the linear layers weights-only; routed experts of a mixture-of-experts model stay W4A4",
)


def is_blackwell(hardware: str) -> bool:
    name = hardware.lower()
    return any(marker in name for marker in BLACKWELL)


def numerics_on(quantization: str, hardware: str) -> EngineNumerics | None:
    """The engine's numerics for a ``quantization`` checkpoint on ``hardware``, where they are not
    the ones the checkpoint declares (None where they are)."""
    if quantization.lower() == "mxfp4" and is_blackwell(hardware):
        return MXFP4_W4A4
    return None


def profiles_to_measure(quantization: str, hardware: list[str]) -> list[tuple[EngineNumerics, list[str]]]:
    """Each numerics other than the declared one that ``hardware`` runs, with the hardware that runs it."""
    found: dict[str, tuple[EngineNumerics, list[str]]] = {}
    for name in hardware:
        numerics = numerics_on(quantization, name)
        if numerics is not None:
            found.setdefault(numerics.key, (numerics, []))[1].append(name)
    return list(found.values())
