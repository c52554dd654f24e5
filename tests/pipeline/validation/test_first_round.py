"""Validation's first round of checking, run in calibration's walk over the layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4prep.pipeline import device
from fp4prep.pipeline.calibrate import calibrate
from fp4prep.pipeline.inputs.corpus import ParityExample
from fp4prep.pipeline.model import merge, streaming
from fp4prep.pipeline.model.reads import ReadTally, tallying
from fp4prep.pipeline.model.safetensors import TensorSource, read_config
from fp4prep.pipeline.modelopt_ext.session import Session
from fp4prep.pipeline.recipes import RECIPES
from fp4prep.pipeline.validation import first_round, parity
from fp4prep.pipeline.validation.prompt_cache import Runs, kv_budget

CPU = device.Compute(torch.device("cpu"), torch.float32)


def examples(vocab: int) -> list[ParityExample]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for k in range(4):
        ids = torch.randint(0, vocab, (30 + 7 * k,), generator=generator).tolist()
        # Two answers right after their prompt (checked on the conversation's own run), two not.
        made.append(ParityExample(ids, ids[:10], [(10, 25)] if k % 2 else [(16, 28)]))
    return made


@pytest.mark.parametrize(("arch", "quantization"), [("llama", "nvfp4"), ("llama", "fp8"), ("glm4_moe", "nvfp4")])
def test_calibration_runs_validations_first_round_to_the_bit(
    make_base: Callable[..., Path], arch: str, quantization: str
) -> None:
    # The first round rides along calibration's walk, each layer as merged (before the recipe's
    # steps, quantizers off; FP8 is ModelOpt's own max calibration, NVFP4 the steps): its states and
    # kept keys and values are what validation's own round computes, and validation, starting from
    # it, finds the same continuations with one read of the layers fewer.
    base = make_base(arch)

    def streamed() -> torch.nn.Module:
        return streaming.build(read_config(base), merge.MergedWeights(TensorSource(base), None, CPU.dtype), CPU, base)

    model = streamed()
    cases = examples(model.config.vocab_size)
    assert first_round.prepare(model, cases, 6, None, beside=1 << 50) is None  # no room beside calibration
    walk = first_round.prepare(model, cases, 6, None)
    assert walk is not None
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (16, 32), generator=generator).tolist()
    with Session(CPU) as session:
        calibrate(model, RECIPES[quantization], tokens, CPU, session, lambda f: None, before_layer=walk.layer)
    done = walk.result()
    assert done is not None and done.cache is not None

    bf16 = streamed()
    sequences, keep = parity.first_round_plan(cases, 6, None)
    runs = Runs(bf16, parity.final_hidden_states, kv_budget(bf16))
    states = runs.first(sequences, keep)
    assert (done.sequences, done.keep) == (sequences, keep)
    assert len(done.states) == len(states)
    for got, want in zip(done.states, states, strict=True):
        assert torch.equal(got, want)
    assert runs.cache is not None and done.cache.slot_of == runs.cache.slot_of
    for mine, theirs in zip(done.cache.kept, runs.cache.kept, strict=True):
        mine.seal()
        theirs.seal()
        assert mine.held is not None and theirs.held is not None
        assert torch.equal(mine.held[0], theirs.held[0]) and torch.equal(mine.held[1], theirs.held[1])

    def counted(run: Callable[[], Any]) -> tuple[Any, int]:
        tally = ReadTally({"base": base}, lambda: "validating")
        with tallying(tally):
            found = run()
        return found, tally.bytes["base"].get("validating", 0)

    alone, read_alone = counted(lambda: parity.reference_of(streamed(), cases, 6))
    ridden, read_ridden = counted(lambda: parity.reference_of(streamed(), cases, 6, done=done))
    assert ridden.expected == alone.expected
    for got, want in zip(ridden.states, alone.states, strict=True):
        assert torch.equal(got, want)
    one = streamed()
    _, one_pass = counted(lambda: parity.final_hidden_states(one, sequences[:1]))  # every layer, the final norm
    assert one_pass > 0 and read_alone - read_ridden == one_pass, (read_alone, read_ridden, one_pass)
