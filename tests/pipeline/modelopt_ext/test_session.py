"""What fp4prep registers with ModelOpt and patches in it lasts one run: a run leaves ModelOpt as it
found it, and two runs in one process (a long-lived worker) write the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fp4prep.pipeline.device import resolve
from fp4prep.pipeline.modelopt_ext import backend
from fp4prep.pipeline.modelopt_ext.session import METHOD, Session

from ..helpers import run_tiny
from ..model.test_streaming import checkpoint_bytes


def modelopt_state() -> dict[str, Any]:
    from modelopt.torch.quantization.mode import CalibrateModeRegistry
    from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq
    from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

    return {
        "backends": {n: tq._QUANT_FUNCTIONAL_BACKENDS.get(n) for n in (backend.NAME, backend.INPUTS)},
        "algorithm": f"{METHOD}_calibrate" in CalibrateModeRegistry,
        "static kernel": tq.static_blockwise_fp4_fake_quant,
        "next layer's capture": LayerActivationCollector.cache_outputs_for_next_layer_calib,
    }


def test_a_session_registers_for_its_run_and_puts_everything_back() -> None:
    before = modelopt_state()
    assert before["backends"] == {backend.NAME: None, backend.INPUTS: None} and not before["algorithm"]
    with Session(resolve("cpu")) as outer:
        inside = modelopt_state()
        assert inside["backends"] == outer.backends and inside["algorithm"]
        assert inside["static kernel"] is not before["static kernel"]  # no Triton here: ours computes
        with Session(resolve("cpu")) as inner:  # a nested one takes over, and hands back
            assert modelopt_state()["backends"] == inner.backends
        assert modelopt_state() == inside
    assert modelopt_state() == before


def test_two_runs_in_one_process_write_the_same_bytes(llama_base: Path, tmp_path: Path, calibration_file: Path) -> None:
    before = modelopt_state()
    first = run_tiny(llama_base, tmp_path / "first", calibration_file=calibration_file)
    assert modelopt_state() == before
    second = run_tiny(llama_base, tmp_path / "second", calibration_file=calibration_file)
    assert checkpoint_bytes(tmp_path / "first") == checkpoint_bytes(tmp_path / "second")
    assert first.parity == second.parity


def test_modelopts_algorithm_outside_a_calibration_is_refused() -> None:
    from fp4prep.pipeline import PipelineError

    with Session(resolve("cpu")) as session, pytest.raises(PipelineError, match="outside a calibration"):
        session.run_layer(None, lambda m: None)  # type: ignore[arg-type]
