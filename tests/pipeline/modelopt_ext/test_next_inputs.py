"""The next decoder layer's inputs come from the layer's max-calibration pass: the same checkpoint
bytes as ModelOpt's own capture, with each layer but the last run once fewer over the corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fp4prep.pipeline import PipelineError
from fp4prep.pipeline.modelopt_ext import next_inputs
from fp4prep.pipeline.modelopt_ext.next_inputs import NextInputs
from tests.tiny import save_adapter

from ..helpers import run_tiny
from ..model.test_streaming import checkpoint_bytes, six_layer_base

BATCHES = 4  # run_tiny's 2048 calibration tokens in sequences of 128, 4 to a batch
LAYERS = 6


def attention_calls(run: Any) -> tuple[Any, int]:
    """``run()`` and how many times any attention module ran meanwhile."""
    calls = [0]

    def hook(module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if type(module).__name__.endswith("Attention"):
            calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        return run(), calls[0]
    finally:
        handle.remove()


@pytest.mark.parametrize(("arch", "quantization"), [("llama", "nvfp4"), ("llama", "fp8"), ("glm4_moe", "mxfp4")])
def test_the_next_layers_inputs_are_the_calibration_passs_outputs(
    tmp_path: Path, tokenizer_dir: Path, calibration_file: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
    quantization: str,
) -> None:
    # NVFP4 runs the recipe's steps after max calibration, FP8 ModelOpt's max calibration alone, the
    # MoE's MXFP4 GPTQ on routed experts (its router counts come from that first pass now).
    base = six_layer_base(tmp_path / "base", tokenizer_dir, arch)
    adapter = save_adapter(base, tmp_path / "adapter", targets=["q_proj", "o_proj"], b_scale=0.05)
    common: dict[str, Any] = {"adapter_dir": adapter, "calibration_file": calibration_file, "quantization": quantization}

    kept, runs_kept = attention_calls(lambda: run_tiny(base, tmp_path / "kept", **common))
    with monkeypatch.context() as patched:
        # ModelOpt's own capture: the layer run once more, quantizers off, before its calibration.
        patched.setattr(NextInputs, "defer", lambda self, getter, layer, loop: self.capture(getter, layer, loop))
        own, runs_own = attention_calls(lambda: run_tiny(base, tmp_path / "own", **common))

    assert checkpoint_bytes(tmp_path / "kept") == checkpoint_bytes(tmp_path / "own")
    assert kept.parity == own.parity and kept.expert_tokens == own.expert_tokens
    assert kept.expert_gptq == own.expert_gptq
    assert runs_own - runs_kept == (LAYERS - 1) * BATCHES

    if quantization == "nvfp4":  # a first pass that quantized would hand on the wrong inputs
        monkeypatch.setattr(next_inputs, "_quantizes", lambda layer: True)
        with pytest.raises(PipelineError, match="first calibration pass quantizes"):
            run_tiny(base, tmp_path / "refused", **common)
