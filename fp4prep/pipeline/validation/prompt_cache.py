"""The keys and values of the prompts whose continuations are being checked, and of the tokens
confirmed after them, kept so that each round of checking computes only what it has not confirmed.

The first round of checking runs every prompt with a guess (or a longer sequence that starts with
it); the attention layers then hand their keys and values to this cache, which keeps the rows of
those prompts (prompt and guess) and counts the prompt as kept. After each round, the tokens a
guess got confirmed are kept too: from the first run's rows, or from the later round's own keys and
values, which the layers hold until then. A later round runs each guess's unconfirmed tokens alone
after its prompt's kept keys. Rows of different lengths are padded, and the padding masked, so any
prompt continues from any row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..device import available_memory

# The keys and values kept while checking guesses (and while decoding the benchmarks' and tests'
# plain greedy continuations) stay within a tenth of the device's free memory and at least this
# many bytes; past it, prompts run again each round (decoding: each further batch of prompts decodes
# all its tokens again, one more pass over the layers per token).
KV_CACHE_BYTES = 128 << 20


def kv_budget(model: Any) -> int:
    return max(KV_CACHE_BYTES, available_memory(next(model.parameters()).device) // 10)


def kv_bytes_per_token(model: Any) -> int:
    """What every layer's keys and values for one token take, together."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # MLA models (DeepSeek) cache wider keys than head_dim says; the hidden size bounds them well.
    width = max(2 * heads * head_dim, 2 * config.hidden_size if hasattr(config, "kv_lora_rank") else 0)
    return int(config.num_hidden_layers) * width * next(model.parameters()).element_size()


class PromptCache(Cache):
    """Kept keys and values, one slot per prompt, every attention layer.

    ``keep`` maps the index of each sequence to keep to its prompt's length and how many of its
    first tokens to record. ``recording(batch)`` before a run of the decoder over the sequences
    ``batch`` (indices, one per row) records the rows of those sequences, each in its own slot
    (``slot_of``), its prompt kept; ``reading(slots)`` before a run that continues the tokens kept
    in ``slots``, one per row; ``extend`` keeps more of a slot's tokens after either.
    """

    def __init__(self, layers: int, keep: dict[int, tuple[int, int]]) -> None:
        self.kept = [_Layer(self) for _ in range(layers)]
        super().__init__(layers=list(self.kept))
        self.keep = keep
        self.slot_of: dict[int, int] = {}
        self.lengths: list[int] = []  # each slot's kept tokens
        self.record: tuple[torch.Tensor, int] | None = None
        self.read: torch.Tensor | None = None

    def recording(self, batch: list[int], device: torch.device) -> None:
        rows = [row for row, index in enumerate(batch) if index in self.keep]
        for row in rows:
            if batch[row] not in self.slot_of:  # a batch walked through the layers records at each
                self.slot_of[batch[row]] = len(self.lengths)
                self.lengths.append(self.keep[batch[row]][0])
        longest = max((self.keep[batch[row]][1] for row in rows), default=0)
        self.record = (torch.tensor(rows, dtype=torch.long, device=device), longest)
        self.read = None

    def reading(self, slots: list[int], device: torch.device) -> None:
        for layer in self.kept:
            layer.seal()
        self.record = None
        self.read = torch.tensor(slots, dtype=torch.long, device=device)

    def extend(self, slot: int, count: int, row: int | None) -> None:
        """Keep ``count`` more tokens in ``slot``: the next of its first run's recorded row
        (``row`` None), or the first of row ``row`` of the last reading run."""
        if count <= 0:
            return
        for layer in self.kept:
            layer.seal()
            if row is not None:
                layer.place(slot, self.lengths[slot], row, count)
        self.lengths[slot] += count

    def width(self) -> int:
        return self.kept[0].get_seq_length() if self.kept else 0


class _Layer(DynamicLayer):
    def __init__(self, owner: PromptCache) -> None:
        super().__init__()
        self.owner = owner
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last reading run's own

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
        self.last = (key_states, value_states)
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
        self.held = _padded([k for k, _ in parts]), _padded([v for _, v in parts])
        self.parts = []

    def place(self, slot: int, at: int, row: int, count: int) -> None:
        """Row ``row``'s first ``count`` keys and values of the last reading run, into ``slot`` at
        position ``at`` (the held tensors widened where they end sooner)."""
        assert self.held is not None and self.last is not None
        if self.held[0].shape[-2] < at + count:
            self.held = _padded([self.held[0]], at + count), _padded([self.held[1]], at + count)
        for held, new in zip(self.held, self.last, strict=True):
            held[slot, :, at : at + count] = new[row, :, :count]

    def get_seq_length(self) -> int:
        if self.owner.record is not None or self.held is None:
            return 0
        return int(self.held[0].shape[-2])


def _padded(parts: list[torch.Tensor], width: int = 0) -> torch.Tensor:
    """``parts`` stacked along the first dimension, each padded along the token dimension to the
    widest (or ``width``)."""
    width = max([width] + [t.shape[-2] for t in parts])
    return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[-2])) for t in parts])


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
    prompts' and the guesses' keys and values where they fit in ``budget`` bytes and the model
    attends to its whole context in every layer; later rounds over the unconfirmed tokens alone
    after them, or, without a cache, over prompt, confirmed tokens and guess again."""

    def __init__(
        self, model: Any, run: Callable[..., list[torch.Tensor]], budget: int, done: FirstRun | None = None
    ) -> None:
        self.model, self._run, self.budget = model, run, budget
        self.done = done  # the first round, already run (in calibration's walk over the same model)
        self.cache: PromptCache | None = None
        self.prompts: dict[int, list[int]] = {}  # by first-round sequence: what later rounds continue

    def first(self, sequences: list[list[int]], keep: dict[int, tuple[int, int]]) -> list[torch.Tensor]:
        """Every sequence's final hidden states; ``keep`` maps a sequence's index to the length of
        the prompt it starts with, which later rounds continue, and of the prompt and guess. Where
        ``done`` ran these sequences already, its states and kept keys and values."""
        self.prompts = {j: sequences[j][:length] for j, (length, _) in keep.items()}
        if self.done is not None and self.done.sequences == sequences and self.done.keep == keep:
            self.cache = self.done.cache
            return self.done.states
        self.cache = self.cache_for(self.model, keep, self.budget)
        return self._run(self.model, sequences, self.cache)

    @staticmethod
    def cache_for(model: Any, keep: dict[int, tuple[int, int]], budget: int) -> PromptCache | None:
        """A cache for the tokens ``keep`` names, where they fit in ``budget`` bytes and the model
        attends to its whole context in every layer."""
        held = len(keep) * max((n for _, n in keep.values()), default=0) * kv_bytes_per_token(model)
        if held <= budget and full_attention(model.config):
            return PromptCache(int(model.config.num_hidden_layers), keep)
        return None

    def then(self, rows: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """For each ``(j, tokens)``: the final hidden states of ``tokens`` run after what the first
        round's sequence ``j`` has confirmed (its prompt, then what ``confirm`` added)."""
        if self.cache is not None:
            return continue_prompts(self.model, self.cache, [(self.cache.slot_of[j], t) for j, t in rows])
        states = self._run(self.model, [self.prompts[j] + t for j, t in rows], None)
        return [s[len(self.prompts[j]) :] for (j, _), s in zip(rows, states, strict=True)]

    def confirm(self, j: int, tokens: list[int], row: int | None) -> None:
        """Sequence ``j`` continues with ``tokens`` too: the next of its first-round guess (``row``
        None), or the first of row ``row`` of the last round's run."""
        self.prompts[j] = self.prompts[j] + tokens
        if self.cache is not None:
            self.cache.extend(self.cache.slot_of[j], len(tokens), row)


@dataclass
class FirstRun:
    """A first round run before the checking starts: its sequences, what it kept (``Runs.first``),
    each sequence's final hidden states and the kept keys and values."""

    sequences: list[list[int]]
    keep: dict[int, tuple[int, int]]
    states: list[torch.Tensor]
    cache: PromptCache | None


def full_attention(config: Any) -> bool:
    """Whether every layer attends to the whole context (no sliding windows, no linear attention):
    the keys the cache keeps are all a later token attends to."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
