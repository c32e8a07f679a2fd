import re

import pytest

from verl_ext.workload.arith import (
    BRIEF_INSTRUCTION,
    DEFAULT_DIFFICULTY,
    INSTRUCTION,
    LEVELS,
    ORIGINAL_DIFFICULTY,
    extract_final_number,
    make_problems,
    reward,
)


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
    assert make_problems(5, seed=1, difficulty=1) == make_problems(20, seed=1, difficulty=1)[:5]


def _operations(question: str) -> list[str]:
    return re.split(r"(?<=[.?])\s+", question)[1:-1]  # between "X has N items." and the question


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_every_level_deterministic_correct_and_within_its_bounds(difficulty):
    level = LEVELS[difficulty]
    a = make_problems(200, seed=7, difficulty=difficulty)
    assert a == make_problems(200, seed=7, difficulty=difficulty)
    assert a != make_problems(200, seed=8, difficulty=difficulty)
    assert len({p.uid for p in a}) == 200
    kinds = set()
    for p in a:
        assert _solve(p.question) == p.answer and p.answer > 0
        ops = _operations(p.question)
        assert level.steps[0] <= len(ops) <= level.steps[1]
        assert level.start[0] <= int(re.search(r" has (\d+) ", p.question).group(1)) <= level.start[1]
        for op in ops:
            if m := re.search(r"(?:gets|finds) (\d+) more", op):
                assert level.operand[0] <= int(m.group(1)) <= level.operand[1]
                kinds.add("add")
            elif "gives away" in op:
                kinds.add("sub")
            elif "piles" in op:
                kinds.add("div")
            else:
                kinds.add("mul")
        assert p.messages()[0]["content"] == f"{p.question}\n{level.instruction}"
    assert kinds == set(level.ops)  # 200 problems use every operation of the level, and no other


def test_levels_differ_and_the_original_stream_is_unchanged():
    streams = {d: make_problems(50, seed=0, difficulty=d) for d in LEVELS}
    for d, e in [(d, e) for d in LEVELS for e in LEVELS if d < e]:
        assert not {p.uid for p in streams[d]} & {p.uid for p in streams[e]}
        assert [p.question for p in streams[d]] != [p.question for p in streams[e]]
    # harder levels: more operations per problem on average
    mean_ops = [sum(len(_operations(p.question)) for p in streams[d]) / 50 for d in sorted(LEVELS)]
    assert mean_ops == sorted(mean_ops) and mean_ops[0] < mean_ops[-1]
    # make_problems' default is the original level, with the problems (and prompts) it always had:
    # the engine tests, data/traces/smollm2_arith_e2.parquet and the replay data were made from them
    assert make_problems(50) == streams[ORIGINAL_DIFFICULTY]
    first = streams[ORIGINAL_DIFFICULTY][0]
    assert first.uid == "arith-0-0" and first.answer == 9 and first.question.startswith(
        "Ines has 6 stickers. Ines triples the number of stickers. Ines splits the stickers into 3 equal piles")
    assert first.instruction == INSTRUCTION
    # the level `verl-ext ab` and the veRL data set use by default is an easier one
    assert DEFAULT_DIFFICULTY != ORIGINAL_DIFFICULTY and LEVELS[DEFAULT_DIFFICULTY].instruction == BRIEF_INSTRUCTION
    assert LEVELS[DEFAULT_DIFFICULTY].steps[1] < LEVELS[ORIGINAL_DIFFICULTY].steps[0]


@pytest.mark.parametrize("difficulty", [0, 5, True, "1"])
def test_bad_difficulty(difficulty):
    with pytest.raises(ValueError, match="difficulty must be one of 1, 2, 3, 4"):
        make_problems(3, difficulty=difficulty)


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


def test_verl_data_set_is_of_the_level_asked_for(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from verl_ext.workload.verl_data import compute_score, main, write_dataset

    def read(path):
        return pq.read_table(path).to_pylist()

    paths = write_dataset(tmp_path / "default", train=5, val=3)
    train, val = read(paths["train"]), read(paths["val"])
    expected = make_problems(5, seed=0, difficulty=DEFAULT_DIFFICULTY)
    assert [r["prompt"] for r in train] == [p.messages() for p in expected]
    assert [r["extra_info"]["problem_id"] for r in train] == [p.uid for p in expected]
    assert [r["reward_model"]["ground_truth"] for r in train] == [str(p.answer) for p in expected]
    assert [r["extra_info"]["problem_id"] for r in val] == [p.uid for p in make_problems(3, seed=1, difficulty=DEFAULT_DIFFICULTY)]
    assert compute_score(train[0]["data_source"], f"so. Answer: {expected[0].answer}", train[0]["reward_model"]["ground_truth"]) == 1.0

    main(["--out", str(tmp_path / "original"), "--train", "5", "--val", "3", "--difficulty", str(ORIGINAL_DIFFICULTY)])
    original = read(tmp_path / "original" / "train.parquet")
    assert [r["prompt"] for r in original] == [p.messages() for p in make_problems(5, seed=0)]
    assert [r["prompt"] for r in original] != [r["prompt"] for r in train]
