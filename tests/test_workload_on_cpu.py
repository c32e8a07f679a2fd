import re

import pytest

from verl_ext.workload.arith import extract_final_number, make_problems, reward


def _solve(question: str) -> int:
    """Independent re-computation of a problem's answer from its text."""
    value = None
    for sentence in re.split(r"(?<=[.?])\s+", question):
        if m := re.search(r" has (\d+) ", sentence):
            value = int(m.group(1))
        elif m := re.search(r"(?:gets|finds) (\d+) more", sentence):
            value += int(m.group(1))
        elif m := re.search(r"gives away (\d+)", sentence):
            value -= int(m.group(1))
        elif m := re.search(r" (doubles|triples|quadruples) ", sentence):
            value *= {"doubles": 2, "triples": 3, "quadruples": 4}[m.group(1)]
        elif m := re.search(r"into (\d+) equal piles", sentence):
            assert value % int(m.group(1)) == 0
            value //= int(m.group(1))
    return value


def test_problems_deterministic_and_correct():
    a, b = make_problems(50, seed=3), make_problems(50, seed=3)
    assert a == b
    assert a != make_problems(50, seed=4)
    assert len({p.uid for p in a}) == 50
    for p in a:
        assert _solve(p.question) == p.answer
        assert p.answer > 0


def test_prefix_stable_when_scaling_prompt_count():
    # the i-th problem does not depend on how many are generated
    assert make_problems(5, seed=1) == make_problems(20, seed=1)[:5]


@pytest.mark.parametrize(
    "text,answer,expected",
    [
        ("3 + 4 = 7. Answer: 7", 7, 1.0),
        ("Answer: 1,234 apples", 1234, 1.0),
        ("He has 5, then 9. Answer: 8", 9, 0.0),  # the number after 'Answer:' wins
        ("so the total is 12", 12, 1.0),
        ("no number here", 3, 0.0),
        ("Answer: 7.5", 7, 0.0),
    ],
)
def test_reward(text, answer, expected):
    assert reward(text, answer) == expected


def test_extract_final_number():
    assert extract_final_number("a 1 b 2") == 2.0
    assert extract_final_number("") is None


def test_bad_prompt_count():
    with pytest.raises(ValueError, match="at least one prompt"):
        make_problems(0)
