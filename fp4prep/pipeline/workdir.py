"""The run's work directory: everything a stopped run resumes from, and what it was made from.

A run with ``work_dir`` set keeps its state there; a run with the same inputs and the same
directory continues where the last one stopped (a dead worker, a requeued job, Ctrl-C), and a run
with other inputs starts afresh. In stage order:

- ``calibration/``: ModelOpt's per-layer checkpoint (each finished layer's quantizers and the next
  layer's inputs; its weights, where calibration changed them, are in ``written/``), with
  ``fold_factors/`` (what folding did to each layer's weights), ``expert_tokens.json`` (the MoE
  routers' counts) and ``written/`` (the weights calibration changed, one file per tensor, read
  instead of the merged ones), ``block_scales/`` (each calibrated layer's static block scales, one
  file per layer, read again by export);
- ``calibrated.pt``: every quantizer once calibration is done (the per-layer files then go);
- ``out/`` and ``exported``: the checkpoint, and the mark that its export finished.

``run.json`` is the fingerprint of the inputs the state was made from.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import PipelineConfig
from .recipes import get_recipe, recipe_for

if TYPE_CHECKING:
    from .device import Compute


STATE_LAYOUT = 2


class WorkDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    fingerprint_file = property(lambda self: self.root / "run.json")
    layer_checkpoints = property(lambda self: self.root / "calibration")
    fold_factors = property(lambda self: self.root / "fold_factors")
    expert_tokens = property(lambda self: self.root / "expert_tokens.json")
    written = property(lambda self: self.root / "written")
    block_scales = property(lambda self: self.root / "block_scales")
    release_codes = property(lambda self: self.root / "release_codes")  # GPTQ's codes for a release, per layer
    calibrated = property(lambda self: self.root / "calibrated.pt")
    out = property(lambda self: self.root / "out")
    exported_mark = property(lambda self: self.root / "exported")

    def claim(self, fingerprint: dict[str, Any]) -> None:
        """Keep the state only if it was made from the inputs ``fingerprint`` describes."""
        try:
            same = json.loads(self.fingerprint_file.read_text()) == fingerprint
        except (OSError, ValueError):
            same = False
        if not same:
            self.clear()
            self.fingerprint_file.write_text(json.dumps(fingerprint, indent=2) + "\n")

    def clear(self) -> None:
        for child in self.root.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()

    def resume_layer(self) -> int:
        """The decoder layer a calibration here would resume from (0: from the start)."""
        from modelopt.torch.quantization.utils.layerwise_calib import detect_resume_point

        found = detect_resume_point(str(self.layer_checkpoints))
        return found[0] if found else 0

    def forget_layers_from(self, start: int, layers_name: str) -> None:
        """Drop what decoder layers ``start`` and after left behind without a committed checkpoint:
        a layer cut short (an error in its steps, a cancel while its outputs were captured) may have
        written back weights already folded, which a run calibrating it again must not start from,
        and its step records would count twice."""
        layer = re.compile(rf"^{re.escape(layers_name)}\.(\d+)\.")
        for path in self.written.glob("*.safetensors"):
            found = layer.match(path.name)
            if found and int(found[1]) >= start:
                path.unlink()
        for path in self.block_scales.glob("*.safetensors"):  # named by the layer's index
            if path.stem.isdigit() and int(path.stem) >= start:
                path.unlink()
        for path in self.fold_factors.glob("*"):
            index = path.name.split(".", 1)[0]
            if index.isdigit() and int(index) >= start:
                path.unlink()

    def calibration_done(self) -> None:
        """Calibration is saved whole (``calibrated``): its per-layer state goes."""
        shutil.rmtree(self.layer_checkpoints, ignore_errors=True)
        shutil.rmtree(self.fold_factors, ignore_errors=True)


@contextlib.contextmanager
def opened(work_dir: Path | None, output_dir: Path) -> Iterator[WorkDir]:
    """``work_dir`` as a ``WorkDir``; with none, a temporary one beside ``output_dir``, removed at
    the end (on the same disk, so the checkpoint moves into place by a rename)."""
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix=".fp4prep-", dir=output_dir.parent) as tmp:
            yield WorkDir(Path(tmp))
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    yield WorkDir(work_dir)


def fingerprint(config: PipelineConfig, compute: Compute, calibration_sha256: str | None) -> dict[str, Any]:
    """What a run's state depends on: a run whose fingerprint differs starts afresh."""
    import fp4prep

    from .formats.engine import VLLM_VERSION

    return {
        "fp4prep": fp4prep.__version__,
        # What the state holds: 2 since ModelOpt's per-layer checkpoint keeps quantizers only (the
        # changed weights are in written/); a directory from before starts afresh.
        "state": STATE_LAYOUT,
        "activation_arithmetic": f"vLLM {VLLM_VERSION}",  # what calibration's quantized inputs follow
        "base": str(config.base_dir.resolve()),
        "adapter": str(config.adapter_dir.resolve()) if config.adapter_dir else None,
        "calibration_sha256": calibration_sha256,
        "general_text": str(config.general_text_file) if config.general_text_file else None,
        "quantization": config.quantization,
        "recipe": _recipe_unless_default(config),
        "calibration_tokens": config.calibration_tokens,
        "sequence_length": config.sequence_length,
        "user_token_minimum": config.user_token_minimum,
        "seed": config.seed,
        "device": compute.device.type,
        "dtype": str(compute.dtype),
    }


def _recipe_unless_default(config: PipelineConfig) -> str | None:
    """The recipe a run calibrates with, where it is not its format's own (a benchmark's candidate,
    MXFP4 calibrated for Blackwell's inputs)."""
    recipe = config.recipe or recipe_for(config.quantization, config.serving_hardware)
    return None if recipe == get_recipe(config.quantization) else repr(recipe)
