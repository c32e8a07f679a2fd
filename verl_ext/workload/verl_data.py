"""The default arithmetic workload (:mod:`verl_ext.workload.arith`) as a veRL dataset.

``write_dataset(out_dir)`` writes ``train.parquet`` and ``val.parquet`` in the layout of veRL's
``RLHFDataset`` (``data_source``, chat-format ``prompt``, ``reward_model.ground_truth``,
``extra_info``), and :func:`compute_score` is its rule-based reward as veRL's custom reward
function::

    data.train_files=DIR/train.parquet data.val_files=DIR/val.parquet
    reward.custom_reward_function.path=pkg://verl_ext.workload.verl_data

(veRL's default function name is ``compute_score``). ``python -m verl_ext.workload.verl_data
--out DIR [--train 64] [--val 8] [--seed 0] [--difficulty 1]`` writes the files; the problems are
of level ``difficulty`` (:data:`verl_ext.workload.arith.LEVELS`; default
:data:`~verl_ext.workload.arith.DEFAULT_DIFFICULTY`, the one the default model gets right about
half the time).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verl_ext.workload.arith import DEFAULT_DIFFICULTY, LEVELS, make_problems, reward

DATA_SOURCE = "verl_ext/arith"


def rows(num: int, seed: int, split: str, difficulty: int = DEFAULT_DIFFICULTY) -> list[dict]:
    """``num`` problems of level ``difficulty`` as veRL dataset rows (the same problems for the
    same ``num``, ``seed`` and ``difficulty``)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": p.messages(),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "problem_id": p.uid},
        }
        for i, p in enumerate(make_problems(num, seed=seed, difficulty=difficulty))
    ]


def write_dataset(out_dir: str | Path, train: int = 64, val: int = 8, seed: int = 0,
                  difficulty: int = DEFAULT_DIFFICULTY) -> dict[str, Path]:
    """Write ``train.parquet`` (seed ``seed``) and ``val.parquet`` (seed ``seed + 1``, so no
    problem is in both), both of level ``difficulty``, under ``out_dir``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    pq.write_table(pa.Table.from_pylist(rows(train, seed, "train", difficulty)), paths["train"])
    pq.write_table(pa.Table.from_pylist(rows(val, seed + 1, "val", difficulty)), paths["val"])
    return paths


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_kwargs) -> float:
    """veRL's custom reward function: 1.0 if the response's final number is the answer, else 0.0."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"verl_ext's arithmetic reward scores only '{DATA_SOURCE}' rows, got '{data_source}'")
    return reward(solution_str, int(ground_truth))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--train", type=int, default=64, help="training prompts")
    parser.add_argument("--val", type=int, default=8, help="validation prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, choices=sorted(LEVELS), default=DEFAULT_DIFFICULTY,
                        help="level of the problems (verl_ext/workload/arith.py; default: %(default)s)")
    args = parser.parse_args(argv)
    for split, path in write_dataset(args.out, args.train, args.val, args.seed, args.difficulty).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
