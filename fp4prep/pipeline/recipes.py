"""The fixed recipe of each output format, and the bar its checkpoint must clear.

Users choose a format, never the knobs. A recipe is the format (ModelOpt's preset, what stays BF16,
the layout) and a list of typed steps run on each decoder layer after ModelOpt's max calibration:

- ``AwqSearch``: AWQ's per-channel scales, one per fold group, scored on the outputs the engine
  computes and folded into the preceding norms and projections (``algorithms/awq.py``, ``fold.py``);
- ``Gptq``: GPTQ's rounding of the (folded) weights with their inputs' Hessians
  (``algorithms/gptq.py``); NVFP4 then fixes its block scales in calibration, as the checkpoint
  stores them.

No steps is ModelOpt's own max calibration, the peers' default. A recipe is checked when it is
built, so one that can't run is refused before any weight is read. Torch-free: the service reads
the thresholds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .formats import FORMATS, Format, get_format
from .serving import MXFP4_W4A4, MXFP4_W4A4_DENSE, numerics_on


@dataclass(frozen=True)
class Thresholds:
    """Minimum behaviour a checkpoint must show against the BF16 merged model.

    The defaults per recipe were set from the embedded demo (SmolLM2-135M, where 4-bit costs the
    most) with margin; the reload bound is tight because on the CPU the reader is bit-exact.
    """

    continuation_top1: float  # on the BF16 model's own greedy continuations, at least
    answer_kl: float  # nats per token on the assistant turns, at most
    identical_greedy: float
    adapter_retention: float  # pooled least-squares coefficient, at least
    reload_max_logit_diff: float  # independent reader vs calibrated fake-quant model, at most


@dataclass(frozen=True)
class AwqSearch:
    """AWQ scales searched per fold group on the quantized outputs, then folded away."""

    alpha_step: float = 0.5  # candidates s = act**alpha / weight**(1 - alpha) for alpha = 0, step, ... 1
    scored_tokens: int = 2048  # about how many calibration tokens each candidate is scored on
    # Each routed expert's down_proj too, folded into its own up rows (algorithms/expert_awq.py). Off
    # in the shipped recipes: on the MoE demo it cut whole-sequence KL (0.49 -> 0.41) but raised KL
    # on the answers (0.057 -> 0.076), the figure the recipes are chosen by (benchmarks/RESULTS.md).
    routed_experts: bool = False

    def check(self) -> None:
        if not 0 < self.alpha_step <= 1:
            raise ValueError(f"AwqSearch.alpha_step must be in (0, 1], not {self.alpha_step}")
        if self.scored_tokens < 1:
            raise ValueError(f"AwqSearch.scored_tokens must be positive, not {self.scored_tokens}")

    def describe(self) -> str:
        return f"AWQ search (alpha step {self.alpha_step:g}), scales folded into the preceding norms and projections"


@dataclass(frozen=True)
class Gptq:
    """GPTQ's rounding of each layer's weights against its inputs' Hessians."""

    hessian_stride: int = 2  # Hessians from every n-th calibration token of each batch
    damp: float = 0.01  # damping, a share of the Hessian's mean diagonal
    # Round the input columns with the largest Hessian diagonal first (GPTQ's activation order),
    # each on its own block's scale; False: in the order they are stored.
    activation_order: bool = False
    # MXFP4 only, each block's power of two (``numerics.mxfp4_steps``): "ceil", the smallest that holds
    # the whole block; "nearest", compressed-tensors' (its largest value rounded to the nearest
    # power); "best", of the ceiling's and the finer one, the one whose rounding moves outputs less.
    mx_exponents: str = "ceil"
    # NVFP4 only, each block's E4M3 scale: "max", the one max calibration gives (it holds the block's
    # largest value); "search", of the codes around it, the one whose rounding moves the block's
    # outputs least (``algorithms/scale_search.py``).
    nv_scales: str = "max"

    def check(self) -> None:
        if self.hessian_stride < 1:
            raise ValueError(f"Gptq.hessian_stride must be at least 1, not {self.hessian_stride}")
        if not 0 < self.damp <= 1:
            raise ValueError(f"Gptq.damp must be in (0, 1], not {self.damp}")
        if self.mx_exponents not in ("ceil", "nearest", "best"):
            raise ValueError(f"Gptq.mx_exponents is 'ceil', 'nearest' or 'best', not {self.mx_exponents!r}")
        if self.nv_scales not in ("max", "search"):
            raise ValueError(f"Gptq.nv_scales is 'max' or 'search', not {self.nv_scales!r}")


Step = AwqSearch | Gptq
_ORDER = (AwqSearch, Gptq)  # the scales GPTQ rounds against are the folded weights'


@dataclass(frozen=True)
class Recipe:
    format: Format
    thresholds: Thresholds
    steps: tuple[Step, ...] = ()
    # Calibrate with each layer's input quantized as the engine computes it on some hardware
    # (``serving.EngineNumerics.key``: MXFP4 inputs as on Blackwell), where that differs from what
    # the format declares; the checkpoint still declares its format.
    calibrate_for: str | None = None
    # Projections (full module names) kept in FP8 (the fp8 format's per-channel, per-token), as a first
    # calibration's rounding errors chose them (``algorithms/mixed.py``); the steps skip them.
    fp8_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kinds = [type(step) for step in self.steps]
        if any(kind not in _ORDER for kind in kinds):
            raise ValueError(f"a recipe's steps are AwqSearch and Gptq, not {kinds}")
        if len(set(kinds)) != len(kinds) or kinds != sorted(kinds, key=_ORDER.index):
            raise ValueError(f"a recipe runs AwqSearch, then Gptq, each at most once, not {[k.__name__ for k in kinds]}")
        if self.steps and not self.format.e2m1:
            raise ValueError(f"{self.format.name} is max-calibrated: its recipe takes no steps")
        if self.calibrate_for not in (None, MXFP4_W4A4.key) or (self.calibrate_for and self.format.name != "mxfp4"):
            raise ValueError(f"{self.format.name} can't be calibrated for {self.calibrate_for!r}")
        gptq = self.gptq
        if gptq is not None and gptq.mx_exponents != "ceil" and self.format.block_scale != "e8m0":
            raise ValueError(f"{self.format.name} has no power-of-two block scales to choose")
        if gptq is not None and gptq.nv_scales != "max" and self.format.block_scale != "e4m3":
            raise ValueError(f"{self.format.name} has no E4M3 block scales to search")
        if self.fp8_modules and self.format.name != "nvfp4":
            # vLLM's ModelOpt mixed-precision loader reads FP8 and NVFP4 layers, not MXFP4 ones.
            raise ValueError(f"{self.format.name} keeps no projections in FP8: only NVFP4 mixes with FP8")
        for step in self.steps:
            step.check()

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def awq(self) -> AwqSearch | None:
        return next((s for s in self.steps if isinstance(s, AwqSearch)), None)

    @property
    def gptq(self) -> Gptq | None:
        return next((s for s in self.steps if isinstance(s, Gptq)), None)

    @property
    def mutates_weights(self) -> bool:
        """Calibration changes weights (scales folded, GPTQ's rounding): each layer is written back."""
        return bool(self.steps)

    @property
    def static_weight_scales(self) -> bool:
        """NVFP4 block scales fixed in calibration (GPTQ rounds against them) rather than computed
        from each block's maximum at export; MXFP4's are always the blocks' own powers of two."""
        return self.gptq is not None and self.format.block_scale == "e4m3"

    @property
    def calibration(self) -> str:
        """How the quantizers are calibrated, in words (the model card and ``fp4prep.json`` say it)."""
        words = self.awq.describe() if self.awq else "max"
        if self.gptq:
            words += ", then GPTQ against " + ("static weight scales" if self.static_weight_scales else "each block's own scale")
            if self.gptq.nv_scales == "search":
                words += " searched on each block's outputs"
            if self.gptq.activation_order:
                words += " in activation order"
            if self.gptq.mx_exponents != "ceil":
                words += {"nearest": ", each block's power of two the nearest to its largest value",
                          "best": ", each block's power of two the one of two that rounds it best"}[self.gptq.mx_exponents]
        if self.calibrate_for == MXFP4_W4A4.key:
            words += ", with the inputs quantized to MXFP4 as vLLM does on Blackwell"
        if self.fp8_modules:
            words += f"; {len(self.fp8_modules)} projections whose rounding moved their outputs most kept in FP8"
        return words


RECIPES: dict[str, Recipe] = {
    "nvfp4": Recipe(
        FORMATS["nvfp4"],
        # GPTQ in activation order (the inputs that weigh most rounded first): on 60 held-back
        # conversations KL on answers 0.052 -> 0.048 on the dense demo's sentiment adapter, 0.057 ->
        # 0.043 on the MoE demo's: benchmarks/peers.py (fp4prep-other-order). Block scales as max
        # calibration sets them: searching each block's E4M3 code on the block's outputs
        # (``nv_scales="search"``, fp4prep-other-scales) moved KL on answers by -23% to +33% over six
        # adapters and two CPUs, lower on three and higher on three (dense dates' task 96% -> 92%):
        # not a gain that holds.
        steps=(AwqSearch(alpha_step=0.5), Gptq(hessian_stride=2, activation_order=True)),
        thresholds=Thresholds(
            continuation_top1=0.9, answer_kl=0.3, identical_greedy=0.5, adapter_retention=0.5, reload_max_logit_diff=1e-3
        ),
    ),
    # GPTQ on each block's own power-of-two grid, with the Hessian of the BF16 inputs the engine
    # multiplies the weights by. Activation order (the inputs that weigh most rounded first) took the
    # demo's KL on answers from 0.040 to 0.016: benchmarks/peers.py.
    "mxfp4": Recipe(
        FORMATS["mxfp4"],
        steps=(Gptq(hessian_stride=2, activation_order=True),),
        thresholds=Thresholds(
            continuation_top1=0.9, answer_kl=0.3, identical_greedy=0.4, adapter_retention=0.5, reload_max_logit_diff=1e-3
        ),
    ),
    "fp8": Recipe(
        FORMATS["fp8"],
        thresholds=Thresholds(
            continuation_top1=0.95, answer_kl=0.05, identical_greedy=0.6, adapter_retention=0.8, reload_max_logit_diff=1e-3
        ),
    ),
}


# MXFP4 for Blackwell, where vLLM 0.33 quantizes its inputs to MXFP4 too: the AWQ search scored on
# those inputs, then GPTQ. On the demo it beat the weights-only recipe on Blackwell (task 48% ->
# 78%) and on Hopper too (KL on answers 0.059 -> 0.031): benchmarks/mxfp4_profiles.py.
MXFP4_FOR_BLACKWELL = Recipe(
    FORMATS["mxfp4"],
    steps=(AwqSearch(alpha_step=0.5), Gptq(hessian_stride=2, activation_order=True)),
    thresholds=RECIPES["mxfp4"].thresholds,
    calibrate_for=MXFP4_W4A4.key,
)


def get_recipe(name: str) -> Recipe:
    return RECIPES[get_format(name).name]


def recipe_for(name: str, serving_hardware: Sequence[str] = ()) -> Recipe:
    """The format's recipe, or, for MXFP4 served only on hardware where vLLM quantizes its inputs
    (Blackwell), the one calibrated for those inputs. Where it is served on other GPUs too, those
    run it weights-only, as declared, and the format's own recipe serves them best: on the demo's
    orders adapter the Blackwell recipe took the declared numerics' task score from 100% to 86%."""
    recipe = get_recipe(name)
    if (
        recipe.name == "mxfp4"
        and serving_hardware
        # Compute capability 12 quantizes the dense layers' inputs only; calibrated for all of them.
        and all(numerics_on("mxfp4", h) in (MXFP4_W4A4, MXFP4_W4A4_DENSE) for h in serving_hardware)
    ):
        return MXFP4_FOR_BLACKWELL
    return recipe
