"""The adapter's own task: evaluation prompts with the answer expected, scored teacher-forced.

A prompt counts as answered when the model, fed its prompt and the expected answer, picks every
token of that answer and then ends its turn: exactly the prompts whose greedy answer is the expected
one token for token. Scored this way, one run of the decoder over all prompts serves the BF16 model
and each candidate, where decoding the answers took one run per generated token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...text import clip, parse_json
from ..config import EVAL_FILE
from ..errors import UserError

# Evaluation prompts scored per run: the first this many of the file.
LIMIT = 50


@dataclass
class TaskSet:
    """Evaluation prompts and their expected answers, as token IDs; ``end`` are the tokens that
    end the assistant's turn."""

    prompts: list[list[int]]
    answers: list[list[int]]
    end: set[int]

    @property
    def sequences(self) -> list[list[int]]:
        """Each prompt followed by its expected answer: what the decoder runs over."""
        return [p + a for p, a in zip(self.prompts, self.answers, strict=True)]

    def hits(self, states: list[torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor]) -> list[bool]:
        """Per prompt, whether the model (its final hidden states over ``sequences``, and its output
        head) answers exactly as expected and then ends its turn."""
        out = []
        for hidden, prompt, answer in zip(states, self.prompts, self.answers, strict=True):
            rows = torch.arange(len(prompt) - 1, len(prompt) + len(answer), device=hidden.device)
            chosen = head(hidden[rows]).argmax(-1).tolist()
            out.append(chosen[:-1] == answer and chosen[-1] in self.end)
        return out

    def success(self, states: list[torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor]) -> float:
        hits = self.hits(states, head)
        return sum(hits) / len(hits) if hits else 0.0


def of_adapter(eval_file: Path | None, adapter_dir: Path | None, tokenizer: Any, end: set[int]) -> TaskSet | None:
    """The prompts of ``eval_file``, else of the adapter's own (``EVAL_FILE`` beside its weights),
    if either is there; ``end`` are the tokens that end the model's turn."""
    if eval_file is None and adapter_dir is not None and (adapter_dir / EVAL_FILE).is_file():
        eval_file = adapter_dir / EVAL_FILE
    return load(eval_file, tokenizer, end) if eval_file is not None else None


def load(eval_file: Path, tokenizer: Any, end: set[int], limit: int = LIMIT) -> TaskSet | None:
    """The first ``limit`` rows of ``eval_file`` (JSONL of ``{"messages": [...], "expected": "..."}``),
    the prompts through the chat template's generation prompt; None when it has no rows."""
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    with open(eval_file, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if len(prompts) == limit:
                break
            if not line.strip():
                continue
            where = f"{eval_file.name} line {number}"
            try:
                row = parse_json(line)
            except ValueError as exc:
                raise UserError(f"{where}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
                raise UserError(f'{where}: needs "messages", a list of chat messages')
            if not isinstance(row.get("expected"), str) or not row["expected"].strip():
                raise UserError(f'{where}: needs "expected", the answer as text (got {clip(repr(row.get("expected")), 40)})')
            try:
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # the template's own error says which message is wrong
                raise UserError(f"{where}: the chat template refused the messages ({clip(str(exc), 120)})") from None
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            expected = row["expected"].strip()
            # The answer's tokens as they follow the prompt (a tokenizer may merge across the join;
            # then the answer alone).
            whole = tokenizer(text + expected, add_special_tokens=False)["input_ids"]
            if whole[: len(prompt)] == prompt:
                answer = whole[len(prompt) :]
            else:
                answer = tokenizer(expected, add_special_tokens=False)["input_ids"]
            prompts.append(prompt)
            answers.append(answer)
    return TaskSet(prompts, answers, end) if prompts else None
