"""What the serving engine computes depends on the GPU it runs on, not only on the checkpoint.

vLLM 0.33 picks its kernels by compute capability (``vllm/model_executor/kernels/linear/__init__.py``
``_POSSIBLE_NVFP4_KERNELS`` and ``_POSSIBLE_MXFP4_KERNELS``, the MoE oracles in
``fused_moe/oracle/``), and three of its choices compute other than the checkpoint declares:

- NVFP4 below Blackwell (Hopper, Ada, Ampere): every FP4×FP4 kernel needs compute capability 10 or
  12, so Marlin runs the linear layers and routed experts weights-only, with BF16 inputs (W4A16);
  it also zeroes every block scale below its floor (``nvfp4_marlin_process_scales``).
- MXFP4 on data-centre Blackwell (compute capability 10: B200, GB200, B300, ...): vLLM reads the
  checkpoint into its W4A4 scheme whatever the config says about activations; FlashInfer quantizes
  every quantized layer's input to MXFP4 and so does ``CutlassExpertsMxfp4`` for routed experts.
- MXFP4 on compute capability 12 (RTX PRO 6000 Blackwell, RTX 5090, GB10): the dense layers run
  FlashInfer's W4A4 as above, but the MXFP4 expert kernel is built for capability 10 and 11 only
  (``mxfp4_experts_quant_supported``), so routed experts run Marlin weights-only.

FP8, NVFP4 on Blackwell and MXFP4 below it run as declared. A run is told the hardware its base is
deployed on, and measures its checkpoint once more in each numerics other than the declared one
(``EngineNumerics``), as the engine will run it there.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hardware names that mean compute capability 12 (consumer and workstation Blackwell), lower case;
# checked before the data-centre ones, whose marker "blackwell" they share.
SM12X = ("rtx pro 6000", "rtx 5090", "rtx 5080", "rtx 5070", "gb10", "dgx spark")
# Hardware names that mean compute capability 10 (data-centre Blackwell), lower case.
SM10X = ("blackwell", "b100", "b200", "b300", "gb200", "gb300")


@dataclass(frozen=True)
class EngineNumerics:
    key: str
    # What the engine does differently from what the checkpoint declares, for people.
    description: str
    # vLLM's setting that makes it run the checkpoint as declared instead, where there is one, and
    # what that setting leaves as it was. Where there is none, the quality gate holds these numerics.
    as_declared_flag: str = ""
    as_declared_effect: str = ""
    # Where the numerics differ from the declared ones: every quantized layer's input ("all"), the
    # dense layers' only ("dense"), or none ("" : weights only where the checkpoint declares W4A4).
    fp4_inputs: str = "all"


MXFP4_W4A4 = EngineNumerics(
    "mxfp4-w4a4",
    "vLLM 0.33 on Blackwell quantizes every quantized layer's input to MXFP4 too (W4A4, FlashInfer)",
    """--kernel-config '{"linear_backend_per_quant": {"mxfp4": "marlin"}}'""",
    # vLLM 0.33 picks CutlassExpertsMxfp4 for MXFP4 routed experts on Blackwell whatever the
    # linear backend: no weights-only MoE kernel there.
    "Marlin runs the linear layers weights-only; routed experts of a mixture-of-experts model stay W4A4",
)
MXFP4_W4A4_DENSE = EngineNumerics(
    "mxfp4-w4a4-dense",
    "vLLM 0.33 on compute capability 12 quantizes the dense layers' inputs to MXFP4 (W4A4, FlashInfer); "
    "routed experts run Marlin weights-only",
    """--kernel-config '{"linear_backend_per_quant": {"mxfp4": "marlin"}}'""",
    "Marlin runs the linear layers weights-only too",
    fp4_inputs="dense",
)
NVFP4_W4A16 = EngineNumerics(
    "nvfp4-w4a16",
    "vLLM 0.33 below Blackwell runs NVFP4 weights-only on Marlin (W4A16: BF16 inputs, block scales "
    "under Marlin's floor zeroed)",
    fp4_inputs="",
)


def _named(hardware: str, markers: tuple[str, ...]) -> bool:
    return any(marker in hardware.lower() for marker in markers)


def is_blackwell(hardware: str) -> bool:
    return _named(hardware, SM12X + SM10X)


def numerics_on(quantization: str, hardware: str) -> EngineNumerics | None:
    """The engine's numerics for a ``quantization`` checkpoint on ``hardware``, where they are not
    the ones the checkpoint declares (None where they are)."""
    quantization = quantization.lower()
    if quantization == "nvfp4":
        return None if is_blackwell(hardware) else NVFP4_W4A16
    if quantization == "mxfp4" and _named(hardware, SM12X):  # before SM10X: they share "blackwell"
        return MXFP4_W4A4_DENSE
    if quantization == "mxfp4" and _named(hardware, SM10X):
        return MXFP4_W4A4
    return None


def profiles_to_measure(
    quantization: str, hardware: list[str], routed_experts: bool = True
) -> list[tuple[EngineNumerics, list[str]]]:
    """Each numerics other than the declared one that ``hardware`` runs, with the hardware that runs
    it. Without routed experts, numerics that differ only in theirs are one."""
    found: dict[str, tuple[EngineNumerics, list[str]]] = {}
    for name in hardware:
        numerics = numerics_on(quantization, name)
        if numerics is MXFP4_W4A4_DENSE and not routed_experts:
            numerics = MXFP4_W4A4
        if numerics is not None:
            found.setdefault(numerics.key, (numerics, []))[1].append(name)
    return list(found.values())


def by_key(key: str | None) -> EngineNumerics | None:
    """The numerics of a ``key`` (a reader's ``numerics`` argument); None for the declared ones."""
    return next((n for n in (MXFP4_W4A4, MXFP4_W4A4_DENSE, NVFP4_W4A16) if n.key == key), None)
