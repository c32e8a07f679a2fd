"""The default workload: procedurally generated multi-step arithmetic word problems.

Deterministic by seed, exact integer answers, and a rule-based reward (1 if the final number of
the response equals the answer, else 0), the same shape as GSM8K-style GRPO rewards.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Liam"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps", "shells", "cards"]

INSTRUCTION = "Solve the problem step by step. End your answer with 'Answer: <number>'."


@dataclass(frozen=True)
class Problem:
    uid: str
    question: str
    answer: int

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.question}\n{INSTRUCTION}"}]


def _step(rng: random.Random, name: str, item: str, value: int) -> tuple[str, int]:
    kind = rng.choice(["add", "sub", "mul", "div"] if value > 1 else ["add", "mul"])
    if kind == "add":
        k = rng.randint(2, 30)
        return f"{name} gets {k} more {item}.", value + k
    if kind == "sub":
        k = rng.randint(1, value - 1)
        return f"{name} gives away {k} {item}.", value - k
    if kind == "mul":
        k = rng.randint(2, 4)
        word = {2: "doubles", 3: "triples", 4: "quadruples"}[k]
        return f"{name} {word} the number of {item}.", value * k
    divisors = [d for d in (2, 3, 4, 5) if value % d == 0]
    if not divisors:
        k = rng.randint(2, 30)
        return f"{name} finds {k} more {item}.", value + k
    d = rng.choice(divisors)
    return f"{name} splits the {item} into {d} equal piles and keeps one pile.", value // d


def make_problems(num: int, seed: int = 0, min_steps: int = 2, max_steps: int = 5) -> list[Problem]:
    """``num`` problems, identical for identical ``(num, seed, min_steps, max_steps)``."""
    if num < 1:
        raise ValueError(f"need at least one prompt, got {num}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"invalid step range [{min_steps}, {max_steps}]")
    problems = []
    for i in range(num):
        rng = random.Random(f"verl_ext-arith-{seed}-{i}")
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(3, 40)
        sentences = [f"{name} has {value} {item}."]
        for _ in range(rng.randint(min_steps, max_steps)):
            text, value = _step(rng, name, item, value)
            sentences.append(text)
        sentences.append(f"How many {item} does {name} have now?")
        problems.append(Problem(uid=f"arith-{seed}-{i}", question=" ".join(sentences), answer=value))
    return problems


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> float | None:
    """The number after the last 'Answer:' if present, else the last number in ``text``."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    numbers = _NUMBER.findall(tail) or _NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def reward(response_text: str, answer: int) -> float:
    """1.0 if the response's final number equals ``answer``, else 0.0."""
    value = extract_final_number(response_text)
    return 1.0 if value is not None and value == answer else 0.0


def encode_prompts(tokenizer, problems: list[Problem]) -> list[list[int]]:
    """Chat-templated prompt token ids (generation prompt appended), one list per problem."""
    return [
        list(tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in problems
    ]


def make_scorer(tokenizer, problems: list[Problem]):
    """``score(request, token_ids) -> reward`` for requests whose ``group_id`` is a problem uid."""
    answers = {p.uid: p.answer for p in problems}

    def score(request, token_ids: list[int]) -> float:
        return reward(tokenizer.decode(token_ids, skip_special_tokens=True), answers[request.group_id])

    return score
