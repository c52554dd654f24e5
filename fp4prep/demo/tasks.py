"""The demo adapters' tasks: what each is trained on and how its answers are scored.

- ``sentiment``: label a short product review as positive or negative in one strict form,
  ``Sentiment: positive``. The base never answers in that form, so success is measurable: the share
  of held-out reviews answered exactly right.
- ``orders``: turn an order written in words into one exact JSON object (``{"item": "mug", "color":
  "blue", "quantity": 3, "city": "Oslo"}``), a longer, structured answer where one wrong token fails it.
- ``dates``: rewrite a date written the way people write it (``the 5th of March, 2021``, ``Mar 5
  2021``) as ISO 8601, ``2021-03-05``: every answer is digits copied or mapped, none of them
  predictable from the instruction.

Rows are made from templates, seeded: every build makes the same ones.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUBJECTS = [
    "The movie",
    "The pasta",
    "This laptop",
    "The hotel room",
    "Our waiter",
    "The concert",
    "The new phone",
    "The book",
    "The coffee",
    "The app",
    "The delivery",
    "The headphones",
    "The museum tour",
    "The pizza",
    "The customer service",
    "The train ride",
    "The jacket",
    "The video game",
    "The hiking trail",
    "The keyboard",
    "The sushi",
    "The podcast",
    "The mattress",
    "The camera",
    "The bakery",
    "The update",
    "The gym",
    "The haircut",
    "The flight",
    "The soup",
]
POSITIVE = [
    "wonderful",
    "excellent",
    "delightful",
    "fantastic",
    "superb",
    "lovely",
    "brilliant",
    "great",
    "amazing",
    "pleasant",
    "outstanding",
    "charming",
]
NEGATIVE = [
    "terrible",
    "awful",
    "disappointing",
    "horrible",
    "dreadful",
    "poor",
    "boring",
    "mediocre",
    "unpleasant",
    "broken",
    "useless",
    "annoying",
]
ENDINGS_POS = ["", " I would recommend it.", " I loved every minute.", " Five stars from me."]
ENDINGS_NEG = ["", " I would not recommend it.", " I want my money back.", " One star from me."]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order_status",
            "description": "Look up the delivery status of an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        },
    }
]


@dataclass(frozen=True)
class Task:
    """A task an adapter is trained on: an instruction, (input, answer) rows, and a split."""

    name: str
    instruction: str
    make_rows: Callable[[int], list[tuple[str, str]]]  # seed -> every row, shuffled
    train_steps: int

    def messages(self, text: str, answer: str | None = None) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": self.instruction + text}]
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
        return messages

    def split(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
        """Train, calibration and evaluation rows: disjoint, deterministic."""
        rows = self.make_rows(1234)
        return rows[:400], rows[400:900], rows[900:1000]


def reviews(seed: int) -> list[tuple[str, str]]:
    """Every (review, answer) the templates make, shuffled by ``seed``."""
    rows = []
    for subject in SUBJECTS:
        for adj in POSITIVE:
            for end in ENDINGS_POS:
                rows.append((f"{subject} was {adj}.{end}", "Sentiment: positive"))
        for adj in NEGATIVE:
            for end in ENDINGS_NEG:
                rows.append((f"{subject} was {adj}.{end}", "Sentiment: negative"))
    random.Random(seed).shuffle(rows)
    return rows


ITEMS = ["mug", "lamp", "chair", "notebook", "backpack", "kettle", "scarf", "umbrella", "candle", "towel"]
COLORS = ["red", "blue", "green", "black", "white", "yellow"]
CITIES = ["Oslo", "Lima", "Cairo", "Dublin", "Austin", "Kyoto", "Lyon", "Perth"]
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
ORDER_FORMS = [
    "Please send {n} {color} {items} to {city}.",
    "I'd like {n} {color} {items} delivered in {city}.",
    "Ship {n} {color} {items} to my address in {city}, thanks.",
    "Can you get {n} {color} {items} to {city} by Friday?",
]


def orders(seed: int) -> list[tuple[str, str]]:
    """Every (order, JSON) the templates make, shuffled by ``seed``."""
    rng = random.Random(seed)
    rows = []
    for item in ITEMS:
        for color in COLORS:
            for city in CITIES:
                for form in ORDER_FORMS:
                    quantity = rng.randint(1, 9)
                    n = NUMBERS[quantity] if rng.random() < 0.5 else str(quantity)
                    text = form.format(n=n, color=color, items=item if quantity == 1 else item + "s", city=city)
                    answer = json.dumps({"item": item, "color": color, "quantity": quantity, "city": city})
                    rows.append((text, answer))
    rng.shuffle(rows)
    return rows


MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DATE_FORMS = [
    "{month} {day}, {year}",
    "{day} {month} {year}",
    "the {nth} of {month}, {year}",
    "{mon} {nth} {year}",
    "{month} {nth}, {year}",
]


def _ordinal(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def dates(seed: int) -> list[tuple[str, str]]:
    """1200 distinct (date in words, ISO date) rows, drawn by ``seed``."""
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    while len(rows) < 1200:
        year, month, day = rng.randint(1950, 2039), rng.randint(1, 12), rng.randint(1, 28)
        name = MONTHS[month - 1]
        text = rng.choice(DATE_FORMS).format(month=name, mon=name[:3], day=day, nth=_ordinal(day), year=year)
        rows.setdefault(text, f"{year:04d}-{month:02d}-{day:02d}")
    shuffled = sorted(rows.items())
    rng.shuffle(shuffled)
    return shuffled


SENTIMENT = Task("sentiment", "Classify the sentiment of this review. Review: ", reviews, train_steps=48)
ORDERS = Task(
    "orders",
    'Extract the order as JSON with the keys "item", "color", "quantity" and "city". Order: ',
    orders,
    train_steps=160,
)
DATES = Task("dates", "Write this date in ISO 8601 form (YYYY-MM-DD). Date: ", dates, train_steps=160)
TASKS = {task.name: task for task in (SENTIMENT, ORDERS, DATES)}
