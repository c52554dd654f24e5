"""The BF16 model's greedy continuations, found by checking guesses rather than decoding.

On a model streamed one layer at a time, a decoding step is a read of every layer for one token. A
teacher-forced run is the same read for every token of a guess, and confirms the guess as far as
the model's own picks agree with it: the pick after the prompt is the greedy token, and each next
pick is too while the guess agreed with the picks before it. So a round keeps a guess up to and
including the first pick that differs from it, and a prompt not finished runs again with new
guesses: the kept picks followed by what came after the same last tokens elsewhere (its own prompt,
the other prompts' continuations so far, the drafts), and by the round's later picks (made after a
wrong token, and often right anyway). The held-back answers are usually what the merged model says,
so most continuations are confirmed in the first round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..inputs.corpus import ParityExample
from .prompt_cache import Runs


def draft(example: ParityExample) -> list[int]:
    """A guess at the BF16 model's continuation of ``example``'s prompt: the answer it was held back
    with (its last assistant turn, or the general text after the prompt)."""
    if not example.answer_spans:
        return []
    start, end = example.answer_spans[-1]
    return example.input_ids[start:end]


@dataclass
class Verified:
    """What ``verified_greedy`` found: each prompt's continuation, the final hidden states over
    prompt and continuation that predict it (``[len(prompt) + len(tokens) - 1, hidden]``), the
    states of the sequences run alongside, and how many runs of the decoder it took."""

    tokens: list[list[int]]
    states: list[torch.Tensor]
    alongside: list[torch.Tensor]
    rounds: int


@torch.no_grad()
def verified_greedy(
    model: Any,
    prompts: list[list[int]],
    drafts: list[list[int]],
    n: int,
    alongside: list[list[int]] | None,
    report: Callable[[float], None],
    *,
    runs: Runs,
    head_of: Callable[[Any], contextlib.AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]],
    eos: set[int],
) -> Verified:
    """Each prompt's greedy continuation of ``n`` tokens (through the first end-of-turn token),
    found by rounds of checking guesses (first its draft), with the states that checked it.

    Every round fixes at least one token, so this takes at most ``n`` rounds, and one where every
    draft was right. The continuation is the one greedy decoding gives, up to the last-bit
    differences between computing a token with or without a KV cache (a token once fixed stays
    fixed). ``alongside`` sequences run with the first round and their states come back too; a
    prompt whose first guess one of them starts with is checked on that sequence's run. ``runs``
    runs the model (``prompt_cache.Runs``: the first round, then the guesses after their prompts),
    ``head_of`` holds the output head, ``eos`` end a turn.
    """
    extra = list(alongside or [])
    tokens: list[list[int] | None] = [None] * len(prompts)
    states: list[torch.Tensor | None] = [None] * len(prompts)
    kept: list[list[int]] = [[] for _ in prompts]
    guesses = [[list(d[:n])] for d in drafts]
    first, source = _first_round(runs, prompts, [g[0] for g in guesses], extra)
    base = [first[j][: len(p)] for j, p in zip(source, prompts, strict=True)]  # the prompts' states
    pending, rounds = list(range(len(prompts))), 0
    with head_of(model) as head:
        while pending:
            rows = [(i, guess) for i in pending for guess in guesses[i]]
            if rounds == 0:
                hidden = [first[source[i]][len(prompts[i]) : len(prompts[i]) + len(g)] for i, g in rows]
            else:
                hidden = runs.then([(source[i], g) for i, g in rows])
            rounds += 1
            best: dict[int, tuple[bool, list[int], list[int], torch.Tensor]] = {}
            for (i, guess), h in zip(rows, hidden, strict=True):
                picks = head(torch.cat([base[i][-1:], h[: len(guess)]])).argmax(-1).tolist() if n else []
                complete, got = _confirmed(picks, guess, len(kept[i]), eos, n)
                if i not in best or (complete, len(got)) > (best[i][0], len(best[i][1])):
                    best[i] = (complete, got, picks, h)
            for i, (complete, got, _, h) in best.items():
                kept[i] = got
                if complete:
                    tokens[i], states[i] = got, torch.cat([base[i], h])[: len(prompts[i]) + len(got) - 1]
            pending = [i for i in pending if tokens[i] is None]
            report(1 - len(pending) / max(1, len(prompts)))
            pool = _Continuations([prompts[j] + (tokens[j] or kept[j]) for j in range(len(prompts))] + list(drafts))
            for i in pending:
                guesses[i] = _guesses(pool, prompts[i], best[i][1], best[i][2], n)
    assert all(t is not None for t in tokens) and all(s is not None for s in states)
    return Verified(tokens, states, first[: len(extra)], max(rounds, 1))  # type: ignore[arg-type]


def _first_round(
    runs: Runs, prompts: list[list[int]], guesses: list[list[int]], extra: list[list[int]]
) -> tuple[list[torch.Tensor], list[int]]:
    """The first round's run: the ``extra`` sequences, and each prompt with its guess unless one of
    them starts with both (a held-back conversation and its answer). Returns every sequence's states
    and, per prompt, the index of the sequence it was checked on."""
    found = [next((j for j, s in enumerate(extra) if s[: len(p) + len(g)] == p + g), None) for p, g in zip(prompts, guesses, strict=True)]
    sequences = extra + [p + g for p, g, j in zip(prompts, guesses, found, strict=True) if j is None]
    own = iter(range(len(extra), len(sequences)))
    source = [next(own) if j is None else j for j in found]
    return runs.first(sequences, {j: len(p) for j, p in zip(source, prompts, strict=True)}), source


def _guesses(pool: _Continuations, prompt: list[int], got: list[int], picks: list[int], n: int) -> list[list[int]]:
    """The next round's guesses for a prompt whose confirmed tokens are ``got``: what followed the
    same last tokens in its text and in the pool, and the round's own later picks."""
    room = n - len(got)
    options = [got + found for found in pool.after(prompt + got, room)]
    options.append(got + picks[len(got) :][:room])  # made after a wrong token, often right anyway
    return [g for k, g in enumerate(options) if g not in options[:k]]


def _confirmed(picks: list[int], guess: list[int], fixed: int, eos: set[int], n: int) -> tuple[bool, list[int]]:
    """The tokens a guess confirms: its first ``fixed`` (confirmed in an earlier round), then the
    picks through the first that differs from it; and whether they make a whole continuation
    (``n`` tokens, or ended by an end-of-turn token)."""
    got = guess[:fixed]
    for j in range(fixed, len(picks)):
        got.append(picks[j])
        if picks[j] in eos or len(got) == n:
            return True, got
        if j == len(guess) or guess[j] != picks[j]:
            break
    return n == 0, got


class _Continuations:
    """What first followed each run of up to ``LOOKUP`` tokens in some sequences: where a
    continuation repeats text seen before (its prompt, another prompt's answer), a guess at what
    comes next."""

    LOOKUP = 4

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.index = self._indexed(sequences)

    @classmethod
    def _indexed(cls, sequences: list[list[int]]) -> dict[tuple[int, ...], tuple[int, int]]:
        index: dict[tuple[int, ...], tuple[int, int]] = {}
        for s, seq in enumerate(sequences):
            for k in range(1, cls.LOOKUP + 1):
                for start in range(len(seq) - k):  # something follows: the run can't be the very end
                    index.setdefault(tuple(seq[start : start + k]), (s, start + k))
        return index

    def after(self, text: list[int], room: int) -> list[list[int]]:
        """Up to ``room`` tokens that followed the longest run of ``text``'s last tokens found, once
        in ``text`` itself (a reply quotes its prompt) and once in the sequences. Each guess is a
        row of the next round, so one per source: on a model no guess predicts (a random one),
        every unfinished prompt costs that many rows per round."""
        found: list[list[int]] = []
        for sequences, index in (([text], self._indexed([text])), (self.sequences, self.index)):
            for k in range(min(self.LOOKUP, len(text)), 0, -1):
                if tuple(text[-k:]) in index:
                    s, at = index[tuple(text[-k:])]
                    found.append(sequences[s][at : at + room])
                    break
        return found
