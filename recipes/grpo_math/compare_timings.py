"""Compare veRL's logged rollout timings of two runs (veRL's `file` logger JSONL).

    python recipes/grpo_math/compare_timings.py A.jsonl B.jsonl [--skip-first 1]

Prints, per metric, the mean over steps of each run and the B/A ratio: rollout time
(`timing_s/gen`), step time, response lengths, rewards, and verl_ext's own counters.
"""

import argparse
import json
import sys

KEYS = (
    "timing_s/gen",
    "timing_s/step",
    "perf/throughput",
    "response_length/mean",
    "response_length/max",
    "critic/score/mean",
)


def load(path, skip):
    rows = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            rows.append(record.get("data", record))
    return rows[skip:]


def mean(rows, key):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps to ignore (default 1)")
    args = p.parse_args(argv)
    a, b = load(args.a, args.skip_first), load(args.b, args.skip_first)
    if not a or not b:
        print("compare_timings: a run has no logged steps after --skip-first", file=sys.stderr)
        return 2
    keys = list(KEYS) + sorted({k for r in a + b for k in r if k.startswith("verl_ext/") and not k.startswith("verl_ext/inflight")})
    print(f"{'metric':40s} {'A':>12s} {'B':>12s} {'B/A':>8s}   ({len(a)} vs {len(b)} steps)")
    for key in keys:
        va, vb = mean(a, key), mean(b, key)
        if va is None and vb is None:
            continue
        ratio = f"{vb / va:8.3f}" if va and vb is not None else "       -"
        fa = "-" if va is None else f"{va:.4g}"
        fb = "-" if vb is None else f"{vb:.4g}"
        print(f"{key:40s} {fa:>12s} {fb:>12s} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
