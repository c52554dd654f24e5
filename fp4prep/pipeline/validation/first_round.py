"""The BF16 merged model's first round of checking, run in calibration's walk over the layers.

Validation's BF16 side starts with a teacher-forced run of the merged model over the held-back
conversations, the task's answers and each prompt with its guess (``parity.reference_of``): on a
streamed model, one read of every decoder layer. Calibration brings every layer of that same model
in once, its weights as merged until the recipe's steps change them; run through each layer there,
before the steps and with its quantizers off, the round costs no read of its own, and validation
starts from its states and kept keys and values (``prompt_cache.FirstRun``). The arithmetic is the
one validation's own round does (``layer_walk``, the same batches): the states are the same to the
bit (``tests/pipeline/validation/test_first_round.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..device import available_memory
from ..inputs.corpus import ParityExample
from ..model.layer_walk import Walk
from . import parity
from .prompt_cache import FirstRun, Runs, kv_budget
from .task import TaskSet


class FirstRound:
    """The first round's batches, walked through each decoder layer as calibration hands it over
    (``layer``), then finished (``result``)."""

    def __init__(self, model: Any, sequences: list[list[int]], keep: dict[int, tuple[int, int]], budget: int) -> None:
        device = next(model.parameters()).device
        self.sequences, self.keep = sequences, keep
        self.cache = Runs.cache_for(model, keep, budget)
        self.everything, self.batches, inputs = parity.batched(sequences, device)
        cache = self.cache
        recording = (lambda b: cache.recording(self.batches[b], device)) if cache is not None else None
        self.walk = Walk(model, inputs, cache, recording)

    def layer(self, layer: torch.nn.Module) -> None:
        """Every batch through the next decoder layer, its weights in place, as the merged model
        computes it: with the layer's quantizers off."""
        from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

        with set_quantizer_by_cfg_context(layer, [{"quantizer_name": "*", "enable": False}]):
            self.walk.layer(self.walk.done, layer)

    def result(self) -> FirstRun | None:
        """The round, once every layer was walked (else None: a calibration resumed part way)."""
        if self.walk.done != len(self.walk.layers):
            return None
        states = parity.unbatched(self.everything, self.batches, self.walk.finish())
        return FirstRun(self.sequences, self.keep, states, self.cache)


def prepare(
    model: Any, examples: list[ParityExample], continuation_tokens: int, task: TaskSet | None, beside: int = 0
) -> FirstRound | None:
    """The first round ``parity.reference_of`` would run for ``examples`` and ``task``, ready to walk
    beside a calibration that needs ``beside`` bytes of the device: its states, and its kept keys
    and values where they fit too, each in what validation's cache may take and in a half of what
    calibration leaves free. None where the states do not fit (validation then runs the round)."""
    sequences, keep = parity.first_round_plan(examples, continuation_tokens, task)
    spare = (available_memory(next(model.parameters()).device) - beside) // 2
    budget = max(0, min(kv_budget(model), spare))
    size = int(model.config.hidden_size) * next(model.parameters()).element_size()  # one token's states
    if sum(len(s) for s in sequences) * size > budget:
        return None
    return FirstRound(model, sequences, keep, budget)
