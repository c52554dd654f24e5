"""The BF16 model's greedy continuations, found by checking guesses rather than decoding.

On a model streamed one layer at a time, a decoding step is a read of every layer for one token. A
teacher-forced run is the same read for every token of a guess, and confirms the guess as far as
the model's own picks agree with it: the pick after the prompt is the greedy token, and each next
pick is too while the guess agreed with the picks before it. So a round keeps a guess up to and
including the first pick that differs from it, and a prompt not finished runs again with new
guesses: the kept picks followed by what came after the same last tokens elsewhere (its own prompt,
the other prompts' continuations so far, the drafts), by the round's later picks (made after a
wrong token, and often right anyway), and token by token from those picks first, then the rest
(where the picks went on right but out of step). The held-back answers are usually what the merged model says,
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
    runs the model (``prompt_cache.Runs``: the first round, then each guess's unconfirmed tokens
    after its prompt and confirmed ones), ``head_of`` holds the output head, ``eos`` end a turn.
    """
    extra = list(alongside or [])
    tokens: list[list[int] | None] = [None] * len(prompts)
    states: list[torch.Tensor | None] = [None] * len(prompts)
    kept: list[list[int]] = [[] for _ in prompts]
    guesses = [[list(d[:n])] for d in drafts]
    first, source = _first_round(runs, prompts, [g[0] for g in guesses], extra)
    base = [first[j][: len(p)] for j, p in zip(source, prompts, strict=True)]  # the prompts' states
    # Per prompt: how many confirmed tokens the runs hold (keys and values, or text), their states.
    fed, known = [0] * len(prompts), [b[:0] for b in base]
    pending, rounds = list(range(len(prompts))), 0
    with head_of(model) as head:
        while pending:
            rows = [(i, guess) for i in pending for guess in guesses[i]]
            hidden = _round_states(runs, first if rounds == 0 else None, rows, source, prompts, fed)
            best: dict[int, tuple[bool, list[int], list[int], torch.Tensor, int]] = {}
            for r, ((i, guess), h) in enumerate(zip(rows, hidden, strict=True)):
                new, last = h[: len(guess) - fed[i]], (known[i] if fed[i] else base[i])[-1:]
                picks = guess[: fed[i]] + head(torch.cat([last, new])).argmax(-1).tolist() if n else []
                h = torch.cat([known[i], new])
                complete, got = _confirmed(picks, guess, len(kept[i]), eos, n)
                if i not in best or (complete, len(got)) > (best[i][0], len(best[i][1])):
                    best[i] = (complete, got, picks, h, r)
            for i, (complete, got, _, h, r) in best.items():
                kept[i] = got
                if complete:
                    tokens[i], states[i] = got, torch.cat([base[i], h])[: len(prompts[i]) + len(got) - 1]
                else:  # the row's tokens its picks confirmed, all but the last pick (not run yet)
                    runs.confirm(source[i], got[fed[i] : len(got) - 1], None if rounds == 0 else r)
                    fed[i], known[i] = len(got) - 1, h[: len(got) - 1]
            rounds += 1
            pending = [i for i in pending if tokens[i] is None]
            report(1 - len(pending) / max(1, len(prompts)))
            pool = _Continuations([prompts[j] + (tokens[j] or kept[j]) for j in range(len(prompts))] + list(drafts))
            for i in pending:
                guesses[i] = _guesses(pool, prompts[i], best[i][1], best[i][2], n)
    assert all(t is not None for t in tokens) and all(s is not None for s in states)
    return Verified(tokens, states, first[: len(extra)], max(rounds, 1))  # type: ignore[arg-type]


def _round_states(
    runs: Runs, first: list[torch.Tensor] | None, rows: list[tuple[int, list[int]]], source: list[int],
    prompts: list[list[int]], fed: list[int],
) -> list[torch.Tensor]:
    """Each row's states over the tokens of its guess it runs: all of them, from the first round's
    run (``first``), or those after the prompt's ``fed`` confirmed tokens, from a run of their own."""
    if first is not None:
        return [first[source[i]][len(prompts[i]) : len(prompts[i]) + len(g)] for i, g in rows]
    return runs.then([(source[i], g[fed[i] :]) for i, g in rows])


def _first_round(
    runs: Runs, prompts: list[list[int]], guesses: list[list[int]], extra: list[list[int]]
) -> tuple[list[torch.Tensor], list[int]]:
    """The first round's run (``first_round_plan``). Returns every sequence's states and, per prompt,
    the index of the sequence it was checked on."""
    sequences, keep, source = first_round_plan(prompts, guesses, extra)
    return runs.first(sequences, keep), source


def first_round_plan(
    prompts: list[list[int]], guesses: list[list[int]], extra: list[list[int]]
) -> tuple[list[list[int]], dict[int, tuple[int, int]], list[int]]:
    """What the first round runs: the ``extra`` sequences, and each prompt with its guess unless one
    of them starts with both (a held-back conversation and its answer). Returns the sequences, the
    keys and values to keep (per sequence a prompt starts: its prompt's length, and its prompt's and
    guess's) and, per prompt, the index of the sequence it is checked on."""
    found: list[int | None] = []
    for p, g in zip(prompts, guesses, strict=True):  # each sequence continues one prompt at most
        found.append(next((j for j, s in enumerate(extra) if s[: len(p) + len(g)] == p + g and j not in found), None))
    sequences = extra + [p + g for p, g, j in zip(prompts, guesses, found, strict=True) if j is None]
    own = iter(range(len(extra), len(sequences)))
    source = [next(own) if j is None else j for j in found]
    keep = {j: (len(p), len(p) + len(g)) for j, p, g in zip(source, prompts, guesses, strict=True)}
    return sequences, keep, source


def _guesses(pool: _Continuations, prompt: list[int], got: list[int], picks: list[int], n: int) -> list[list[int]]:
    """The next round's guesses for a prompt whose confirmed tokens are ``got``: what followed the
    same last tokens in its text and in the pool, the round's own later picks, and a guess chained
    from those picks and the rest."""
    room = n - len(got)
    later = picks[len(got) :]  # made after a wrong token: often right anyway, or right further on
    options = [got + found for found in pool.after(prompt + got, room)]
    options.append(got + later[:room])
    options.append(got + pool.chained(prompt + got, later, room))
    options = [g for k, g in enumerate(options) if g not in options[:k] and len(g) > len(got)]
    return options or [got]  # nothing to guess: the row still finds the next token


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
            where = self._longest(text, index)
            if where is not None:
                found.append(sequences[where[0]][where[1] : where[1] + room])
        return found

    def chained(self, text: list[int], later: list[int], room: int) -> list[int]:
        """Up to ``room`` tokens, each what followed the longest run of the last tokens so far in
        ``later`` (a round's picks after a wrong token), else in ``text``, else in the sequences.
        Where the picks went on right but out of step (the wrong token was one of two where the
        model writes one), they are found again after the tokens that put them back in step."""
        sources = [([later], self._indexed([later])), ([text], self._indexed([text])), (self.sequences, self.index)]
        out: list[int] = []
        while len(out) < room:
            step = self._next(text + out, sources)
            if step is None:
                break
            out.append(step)
        return out

    def _next(self, text: list[int], sources: list[tuple[list[list[int]], dict[tuple[int, ...], tuple[int, int]]]]) -> int | None:
        """The token that followed the longest run of ``text``'s last tokens in the first source
        that holds one."""
        for sequences, index in sources:
            where = self._longest(text, index)
            if where is not None:
                return sequences[where[0]][where[1]]
        return None

    @classmethod
    def _longest(cls, text: list[int], index: dict[tuple[int, ...], tuple[int, int]]) -> tuple[int, int] | None:
        """Where (sequence, position) the longest run of ``text``'s last tokens in ``index`` was
        first followed by something."""
        for k in range(min(cls.LOOKUP, len(text)), 0, -1):
            found = index.get(tuple(text[-k:]))
            if found is not None:
                return found
        return None
