"""The parity metrics themselves: a model compared with itself agrees everywhere with zero KL, each
metric counts the positions it says it does, a damaged copy shows on every one of them, and the
figures computed teacher-forced are the ones decoding gives."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp4prep.pipeline.inputs.corpus import ParityExample
from fp4prep.pipeline.validation import continuations, parity, prompt_cache
from fp4prep.pipeline.validation.decoding import greedy
from fp4prep.pipeline.validation.parity import (
    compare,
    final_hidden_states,
    reference_of,
    token_parity,
    verified_greedy,
)
from fp4prep.pipeline.validation.task import TaskSet


def examples(vocab: int) -> list[ParityExample]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for _ in range(3):
        ids = torch.randint(0, vocab, (40,), generator=generator).tolist()
        made.append(ParityExample(ids, ids[:10], [(20, 40)]))  # 10 prompt tokens, an answer at 20..39
    return made


def test_a_model_agrees_with_itself_and_a_damaged_copy_shows(llama_base: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_base, dtype=torch.float32).eval()
    cases = examples(model.config.vocab_size)
    same = token_parity(model, model, cases, continuation_tokens=6)
    assert (same.prompts, same.tokens, same.answer_tokens) == (3, 3 * 39, 3 * 20)
    assert same.continuation_tokens <= 3 * 6  # greedy stops early only at an end-of-turn token
    assert (same.top1_agreement, same.answer_top1, same.continuation_top1, same.identical_greedy) == (1.0, 1.0, 1.0, 1.0)
    # Zero but for float rounding: the reference's states come from the runs that found its
    # continuations, batched with other sequences than the candidate's one run.
    assert max(abs(same.mean_kl), abs(same.answer_kl), abs(same.continuation_kl)) < 1e-6

    damaged = copy.deepcopy(model)
    with torch.no_grad():
        for layer in damaged.model.layers:
            weight = layer.mlp.down_proj.weight
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * 4 * weight.std())
    worse = token_parity(model, damaged, cases, continuation_tokens=6)
    # A random tiny model's distributions are nearly flat, so KL stays small; the top-1 choices move.
    assert worse.answer_kl > 0.001 and worse.mean_kl > 0.001 and worse.continuation_kl > 0.001
    assert worse.answer_top1 < 0.5 and worse.top1_agreement < 0.5 and worse.continuation_top1 < 0.5
    assert worse.identical_greedy < 1.0


def test_teacher_forced_agreement_is_what_decoding_the_candidate_gives(llama_base: Path) -> None:
    # The identical-greedy share and the task score are computed without decoding the candidate:
    # on a lightly damaged copy, some continuations and answers survive and some do not, and each
    # figure must equal what greedy decoding of that copy gives.
    model = AutoModelForCausalLM.from_pretrained(llama_base, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    cases = [ParityExample(ids, ids[:12], [(12, 30)]) for ids in torch.randint(0, vocab, (12, 30), generator=generator).tolist()]
    prompts = [e.prompt_ids for e in cases]
    # The task: each prompt's own greedy answer of 3 tokens, its turn ended by the 4th token picked.
    picked = greedy(model, prompts, 4)
    assert all(len(p) == 4 for p in picked), "a random model ended its turn early; pick another seed"
    tasks = TaskSet(prompts, [p[:3] for p in picked], {p[3] for p in picked})
    reference = reference_of(model, cases, 8, task=tasks)
    assert reference.task_success == 1.0

    damaged = copy.deepcopy(model)
    with torch.no_grad():
        for layer in damaged.model.layers:
            weight = layer.mlp.down_proj.weight
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.15 * weight.std())
    measured = compare(reference, damaged)
    decoded = greedy(damaged, prompts, 8)
    identical = sum(a == b for a, b in zip(decoded, reference.expected, strict=True)) / len(cases)
    assert 0.0 < identical < 1.0, "the damage should leave some continuations and change others"
    assert measured.parity.identical_greedy == identical
    answered = [row[:4] for row in decoded]
    hits = sum(row[:3] == t and row[3] in tasks.end for row, t in zip(answered, tasks.answers, strict=True))
    assert 0 < hits < len(cases) and measured.task_success == hits / len(cases)


def test_a_rounds_later_picks_out_of_step_still_make_a_guess() -> None:
    # The model goes on 10 11 12 13 20 21 (11 12: one word in two tokens); the round's guess had one
    # token, 50, where the model writes 11 12. Its picks after 50 (13 20 21) are right but one token
    # out of step, and the other answers (the pool) go on 13 30 after 11 12. Only the guess chained
    # from both (the pool's 12 13, then the picks' 20 21) is the continuation.
    prompt, truth = [1, 2, 3], [10, 11, 12, 13, 20, 21]
    guess = [10, 50, 13, 20, 21, 22]
    picks = [10, 11, 13, 20, 21, 22, 23]  # the model's pick at each position of the guess, and after
    got = [10, 11]  # the guess's first token, then the model's correction
    pool = continuations._Continuations([[5, 11, 12, 13, 30, 31]])
    guesses = continuations._guesses(pool, prompt, got, picks, len(truth))
    assert all(g[:2] == got for g in guesses) and guess not in guesses
    assert [g for g in guesses if g == truth] == [truth], guesses
    assert pool.chained(prompt + got, picks[2:], 4) == truth[2:]


@pytest.mark.parametrize("runs", ["cached", "cached from several runs", "not cached"])
def test_checking_guesses_finds_what_greedy_decoding_finds(
    llama_base: Path, runs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The BF16 model's continuations come from checking guesses teacher-forced: whatever the guess,
    # the continuation is the one decoding gives, a right guess takes one run of the decoder, and
    # every run fixes at least one token. Later rounds run the guesses alone after the prompts' kept
    # keys and values (kept from one run of the decoder, or from several when the first round is
    # too long for one), or (a model with sliding windows, a cache too big) prompt and guess again.
    if runs == "not cached":
        monkeypatch.setattr(prompt_cache, "full_attention", lambda config: False)
    recordings: list[list[int]] = []
    if runs == "cached from several runs":
        monkeypatch.setattr(parity, "TOKENS_PER_PASS", 40)
        record = prompt_cache.PromptCache.recording
        monkeypatch.setattr(
            prompt_cache.PromptCache, "recording", lambda self, batch, device: (recordings.append(batch), record(self, batch, device))
        )
    later: list[list[int]] = []  # per round after the first, how many tokens each row ran
    then = prompt_cache.Runs.then
    monkeypatch.setattr(prompt_cache.Runs, "then", lambda self, rows: (later.append([len(t) for _, t in rows]), then(self, rows))[1])
    model = AutoModelForCausalLM.from_pretrained(llama_base, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (8 + k,), generator=generator).tolist() for k in range(5)]
    decoded = greedy(model, prompts, 10)
    noise = torch.randint(0, vocab, (5, 10), generator=generator).tolist()
    guesses = {
        "right": (decoded, 1),
        # Right for three tokens, then wrong: more rounds, but fewer than one per token.
        "half right": ([d[:3] + w[3:] for d, w in zip(decoded, noise, strict=True)], 9),
        "wrong": (noise, 10),
        "none": ([[] for _ in prompts], 10),
    }
    for name, (drafts, most) in guesses.items():
        # The first prompt with its first three tokens is a sequence run alongside: checked on it.
        recordings.clear()
        later.clear()
        found = verified_greedy(model, prompts, drafts, 10, alongside=[prompts[0] + decoded[0][:3]])
        assert found.tokens == decoded, name
        assert (len(recordings) > 1) == (runs == "cached from several runs"), recordings
        assert 1 <= found.rounds <= most, (name, found.rounds)
        # A round runs only what is not confirmed yet: at least one token more each round, and all
        # but the last confirmed one are kept (as keys and values, or run again with the prompt).
        assert len(later) == found.rounds - 1
        for r, lengths in enumerate(later, 1):
            assert max(lengths) <= 10 - r + 1, (name, r, lengths)
        # The states come with the continuation they checked, as one teacher-forced run gives them.
        plain = final_hidden_states(model, [p + t for p, t in zip(prompts, decoded, strict=True)])
        for got, want, p, t in zip(found.states, plain, prompts, decoded, strict=True):
            assert got.shape[0] == len(p) + len(t) - 1
            torch.testing.assert_close(got, want[: got.shape[0]], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(found.alongside[0], plain[0][: len(prompts[0]) + 3], atol=1e-4, rtol=1e-4)
    assert verified_greedy(model, prompts, decoded, 10).rounds == 1
    # As validation runs it: each prompt with its right guess is the start of a conversation run alongside.
    conversations = [p + d + [0] for p, d in zip(prompts, decoded, strict=True)]
    found = verified_greedy(model, prompts, decoded, 10, alongside=conversations)
    assert found.tokens == decoded and found.rounds == 1


def test_a_sequence_that_starts_another_is_read_off_that_ones_run(llama_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A candidate runs the prompts with the BF16 model's continuations; where a continuation is the
    # held-back answer, that sequence starts its conversation, and its states are the conversation's.
    model = AutoModelForCausalLM.from_pretrained(llama_base, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = ids
    sequences = [a[:8], a, b[:8], a[:8], b[:12], a[:3] + b[:4]]
    plain = final_hidden_states(model, sequences)
    ran: list[list[list[int]]] = []
    monkeypatch.setattr(
        parity, "final_hidden_states", lambda m, s, alone=None: (ran.append(s), final_hidden_states(m, s, alone=alone))[1]
    )
    states = parity.prefix_states(model, sequences)
    assert ran == [[a, b[:12], a[:3] + b[:4]]]  # the longest of each family, once
    for got, want in zip(states, plain, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
