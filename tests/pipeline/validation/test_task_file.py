"""The adapter's evaluation file: read into prompts and expected answers as they follow the chat
template, and every bad line refused naming the file, the line and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fp4prep.pipeline.errors import UserError
from fp4prep.pipeline.validation import task

ROW = {"messages": [{"role": "user", "content": "Classify: great pizza."}], "expected": "Sentiment: positive"}


def test_prompts_and_answers_are_the_templates_tokens(tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(ROW) for _ in range(3)) + "\n\n" + json.dumps({**ROW, "expected": " Sentiment: negative \n"}) + "\n")
    loaded = task.load(path, tokenizer, {2}, limit=3)
    assert loaded is not None and len(loaded.prompts) == 3  # the first 3 rows only
    text = tokenizer.apply_chat_template(ROW["messages"], tokenize=False, add_generation_prompt=True)
    whole = tokenizer(text + ROW["expected"], add_special_tokens=False)["input_ids"]
    assert loaded.sequences[0] == whole
    assert tokenizer.decode(loaded.answers[0]) == "Sentiment: positive"
    stripped = task.load(path, tokenizer, {2})
    assert stripped is not None and tokenizer.decode(stripped.answers[3]) == "Sentiment: negative"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert task.load(empty, tokenizer, {2}) is None


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "eval.jsonl line 2: not JSON"),
        (json.dumps({"expected": "x"}), 'eval.jsonl line 2: needs "messages"'),
        (json.dumps({"messages": ROW["messages"], "expected": 7}), 'eval.jsonl line 2: needs "expected", the answer as text (got 7)'),
        (json.dumps({"messages": ROW["messages"], "expected": "  "}), 'line 2: needs "expected"'),
        (json.dumps({"messages": [{"role": "user", "content": "a"}] * 2 + [{"role": "narrator"}], "expected": "x"}), "eval.jsonl line 2: the chat template refused"),
    ],
)
def test_a_bad_line_is_refused_by_its_number(tokenizer_dir: Path, tmp_path: Path, line: str, says: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + line + "\n")
    with pytest.raises(UserError) as caught:
        task.load(path, tokenizer, {2})
    assert says in str(caught.value)
