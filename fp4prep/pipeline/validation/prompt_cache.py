"""The keys and values of the prompts whose continuations are being checked, kept from the first
run of the decoder so that later runs compute only the guesses.

The first round of checking runs every prompt with a guess (or a longer sequence that starts with
it); the attention layers then hand their keys and values to this cache, which keeps the rows of
those prompts, prompt tokens only, and gives them back unchanged. A later round runs each guess
alone after its prompt's kept keys: its attention sees the prompt's keys, then its own. Rows of
different lengths are padded, and the padding masked, so any prompt continues from any row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PromptCache(Cache):
    """Kept keys and values, one slot per prompt, every attention layer.

    ``keep`` maps the index of each sequence to keep to its prompt's length. ``recording(batch)``
    before a run of the decoder over the sequences ``batch`` (indices, one per row) keeps the rows
    of those sequences, each in its own slot (``slot_of``); ``reading(slots)`` before a run that
    continues the prompts kept in ``slots``, one per row.
    """

    def __init__(self, layers: int, keep: dict[int, int]) -> None:
        self.kept = [_Layer(self) for _ in range(layers)]
        super().__init__(layers=list(self.kept))
        self.keep = keep
        self.slot_of: dict[int, int] = {}
        self.lengths: list[int] = []  # each slot's prompt length
        self.record: tuple[torch.Tensor, int] | None = None
        self.read: torch.Tensor | None = None

    def recording(self, batch: list[int], device: torch.device) -> None:
        rows = [row for row, index in enumerate(batch) if index in self.keep]
        for row in rows:
            self.slot_of[batch[row]] = len(self.lengths)
            self.lengths.append(self.keep[batch[row]])
        longest = max((self.keep[batch[row]] for row in rows), default=0)
        self.record = (torch.tensor(rows, dtype=torch.long, device=device), longest)
        self.read = None

    def reading(self, slots: list[int], device: torch.device) -> None:
        for layer in self.kept:
            layer.seal()
        self.record = None
        self.read = torch.tensor(slots, dtype=torch.long, device=device)

    def width(self) -> int:
        return self.kept[0].get_seq_length() if self.kept else 0


class _Layer(DynamicLayer):
    def __init__(self, owner: PromptCache) -> None:
        super().__init__()
        self.owner = owner
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        if owner.record is not None:
            rows, length = owner.record
            if len(rows):
                self.parts.append((key_states[rows, :, :length], value_states[rows, :, :length]))
            return key_states, value_states
        assert owner.read is not None and self.held is not None
        keys, values = self.held
        return (
            torch.cat([keys.index_select(0, owner.read), key_states], dim=-2),
            torch.cat([values.index_select(0, owner.read), value_states], dim=-2),
        )

    def seal(self) -> None:
        """The parts recorded run by run, as one tensor each for keys and values (padded to the
        longest part, the padding never attended to)."""
        if not self.parts:
            return
        parts = ([self.held] if self.held is not None else []) + self.parts
        width = max(k.shape[-2] for k, _ in parts)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[-2]))

        self.held = (torch.cat([pad(k) for k, _ in parts]), torch.cat([pad(v) for _, v in parts]))
        self.parts = []

    def get_seq_length(self) -> int:
        if self.owner.record is not None or self.held is None:
            return 0
        return int(self.held[0].shape[-2])


@torch.no_grad()
def continue_prompts(model: Any, cache: PromptCache, rows: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """Final hidden states of each ``(slot, tokens)``: ``tokens`` run after the prompt kept in that
    slot, one run of the decoder for all rows (a row may have no tokens: no states)."""
    device = next(model.parameters()).device
    longest = max((len(t) for _, t in rows), default=0)
    if longest == 0:
        return [torch.empty(0) for _ in rows]
    cache.reading([slot for slot, _ in rows], device)
    width = cache.width()
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), width + longest, dtype=torch.long)
    positions = torch.zeros(len(rows), longest, dtype=torch.long)
    for r, (slot, tokens) in enumerate(rows):
        prompt = cache.lengths[slot]
        ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[r, :prompt] = 1
        mask[r, width : width + len(tokens)] = 1
        positions[r] = prompt + torch.arange(longest)
    hidden = model.get_decoder()(
        input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
        cache=cache, use_cache=True,
    ).last_hidden_state
    return [hidden[r, : len(tokens)] for r, (_, tokens) in enumerate(rows)]


class Runs:
    """How the checking rounds run a model: the first over whole sequences (``run``), keeping the
    prompts' keys and values where they fit in ``budget`` bytes and the model attends to its whole
    context in every layer; later rounds over the guesses alone after them, or, without a cache,
    over prompt and guess again."""

    def __init__(self, model: Any, run: Callable[..., list[torch.Tensor]], bytes_per_token: int, budget: int) -> None:
        self.model, self._run = model, run
        self.bytes_per_token, self.budget = bytes_per_token, budget
        self.cache: PromptCache | None = None
        self.prompts: dict[int, list[int]] = {}  # by first-round sequence: the prompt it starts with

    def first(self, sequences: list[list[int]], keep: dict[int, int]) -> list[torch.Tensor]:
        """Every sequence's final hidden states; ``keep`` maps a sequence's index to the length of
        the prompt it starts with, which later rounds continue."""
        held = len(keep) * max(keep.values(), default=0) * self.bytes_per_token
        if held <= self.budget and full_attention(self.model.config):
            self.cache = PromptCache(int(self.model.config.num_hidden_layers), keep)
        self.prompts = {j: sequences[j][:length] for j, length in keep.items()}
        return self._run(self.model, sequences, self.cache)

    def then(self, rows: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """For each ``(j, tokens)``: the final hidden states of ``tokens`` run after the prompt the
        first round's sequence ``j`` starts with."""
        if self.cache is not None:
            return continue_prompts(self.model, self.cache, [(self.cache.slot_of[j], t) for j, t in rows])
        states = self._run(self.model, [self.prompts[j] + t for j, t in rows], None)
        return [s[len(self.prompts[j]) :] for (j, _), s in zip(rows, states, strict=True)]


def full_attention(config: Any) -> bool:
    """Whether every layer attends to the whole context (no sliding windows, no linear attention):
    the keys the cache keeps are all a later token attends to."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
