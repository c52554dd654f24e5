"""Several batches through a streamed model, each decoder layer read once for all of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fp4prep.pipeline import device
from fp4prep.pipeline.model import merge, streaming
from fp4prep.pipeline.model.reads import ReadTally, tallying
from fp4prep.pipeline.model.safetensors import TensorSource, read_config
from fp4prep.pipeline.validation import parity


@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_every_batch_goes_through_a_layer_while_it_is_read_once(
    make_base: Callable[..., Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A candidate's run batches its sequences; the decoder run once per batch reads every layer once
    # per batch. Walked layer by layer, the states are the same to the bit and each layer is read
    # once, however many batches; a sequence run alone (the reload check's) comes back after them.
    base = make_base(arch)
    compute = device.Compute(torch.device("cpu"), torch.float32)
    model = streaming.build(read_config(base), merge.MergedWeights(TensorSource(base), None, compute.dtype), compute, base)
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 9, 14, 20, 26, 31, 40)]
    alone = sequences[2][:6]
    monkeypatch.setattr(parity, "TOKENS_PER_PASS", 64)
    batches = parity._batches(sequences)
    assert len(batches) >= 4, batches

    def counted(run: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
        tally = ReadTally({"base": base}, lambda: "validating")
        with tallying(tally):
            states = run()
        return states, tally.bytes["base"]["validating"]

    def per_batch() -> list[torch.Tensor]:
        states: list[torch.Tensor] = [torch.empty(0)] * (len(sequences) + 1)
        for batch in batches + [[len(sequences)]]:
            ids, mask = parity.padded([(sequences + [alone])[j] for j in batch], torch.device("cpu"))
            out = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            for row, j in enumerate(batch):
                states[j] = out[row, : len((sequences + [alone])[j])]
        return states

    plain, read_per_batch = counted(per_batch)
    walked, read_walking = counted(lambda: parity.final_hidden_states(model, sequences, alone=[alone]))
    assert len(walked) == len(sequences) + 1
    for got, want in zip(walked, plain, strict=True):
        assert torch.equal(got, want)
    # The decoder layers and the final norm, read once: what the runs per batch read, over their number.
    assert read_walking * (len(batches) + 1) == read_per_batch, (read_walking, read_per_batch)
    # What the walk brought in went back out: no layer keeps its weights.
    layers = streaming.decoder_layers(model)[1]
    assert {p.device.type for layer in layers for p in layer.parameters()} == {"meta"}
    # Alone, a sequence is computed as a forward of it by itself computes it (the reload check's
    # reference), not as it would be in a padded batch.
    assert torch.equal(walked[-1], model.get_decoder()(input_ids=torch.tensor([alone])).last_hidden_state[0])
