"""Every strategy against `baseline` and `oracle` over a scenario matrix, in the simulator.

Cells: cost-model presets x workload shapes x similarity levels (defaults: `h100-7b`, `h100-32b`,
`h800-32b`; mean 4k / max 16k and mean 16k / max 64k tokens; `measured` and `published`). Each
cell is one synchronous rollout of the synthetic epoch on `--instances` instances (one workload
per cell, shared by its arms). Per arm: throughput ratio to `baseline`, tail ratio (the last 10%
of requests' span against `baseline`'s), tokens per step, and draft acceptance. `min_ratio` is
the lowest throughput ratio of any strategy arm over the matrix; the rule is no cell below 0.98.

    OMP_NUM_THREADS=1 python scripts/bench_matrix.py --json                  # the full matrix (long)
    OMP_NUM_THREADS=1 python scripts/bench_matrix.py --json --prompts 64     # scaled down
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

PRESETS = ("h100-7b", "h100-32b", "h800-32b")
SHAPES = {"4k": (4096, 16384), "16k": (16384, 65536)}
LEVELS = ("measured", "published")
#: each strategy with its paper's defaults
ARMS = ("baseline", "seer", "rhyme", "rlhfspec", "specactor", "oracle")
RULE = 0.98


def run_cell(preset: str, shape: str, level: str, arms, prompts: int, samples: int, instances: int, seed: int) -> dict:
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    mean, longest = SHAPES[shape]
    out = tempfile.mkdtemp(prefix="verl_ext_matrix_")
    t = time.perf_counter()
    try:
        cfg = SimConfig(strategies=list(arms), preset=preset, instances=instances, similarity=level, seed=seed,
                        synth={"prompts": prompts, "samples": samples, "mean_len": mean, "max_len": longest},
                        out=out + "/run")
        got = run_sim_ab(cfg, progress=False)["strategies"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    base = got["baseline"]
    cell = {"preset": preset, "shape": shape, "similarity": level, "seconds": round(time.perf_counter() - t, 1),
            "arms": {}}
    for arm, m in got.items():
        cell["arms"][arm] = {
            "throughput_ratio": round(base["wall_s"] / m["wall_s"], 4),
            "tail_ratio": round(m["tail_s"] / base["tail_s"], 4) if base["tail_s"] else None,
            "tokens_per_step": round(m["tokens_per_step"], 3) if m.get("tokens_per_step") else None,
            "draft_acceptance": round(m["draft_acceptance"], 3) if m.get("draft_acceptance") else None,
            "wall_s": round(m["wall_s"], 2),
        }
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a table per cell)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--arms", default=",".join(ARMS), help="strategy arms (baseline is always run)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    shapes = split(args.shapes)
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape(s) {bad}; shapes: {list(SHAPES)}")
    arms = split(args.arms)
    arms = arms if "baseline" in arms else ["baseline", *arms]
    cells = []
    for preset in split(args.presets):
        for shape in shapes:
            for level in split(args.levels):
                cells.append(run_cell(preset, shape, level, arms, args.prompts, args.samples, args.instances, args.seed))
                print(json.dumps(cells[-1]), file=sys.stderr, flush=True)  # each cell as it ends: long runs keep them
                if not args.json:
                    c = cells[-1]
                    print(f"{preset} {shape} {level} ({c['seconds']} s)")
                    for arm, m in c["arms"].items():
                        print(f"  {arm:<12} x{m['throughput_ratio']:.3f}  tail x{m['tail_ratio'] or 0:.3f}  "
                              f"tok/step {m['tokens_per_step'] or 0:.2f}")
    ratios = [(c, arm, m["throughput_ratio"]) for c in cells for arm, m in c["arms"].items()
              if arm not in ("baseline", "oracle")]
    low = min(ratios, key=lambda x: x[2]) if ratios else None
    out = {
        "config": {"prompts": args.prompts, "samples": args.samples, "instances": args.instances, "seed": args.seed,
                   "arms": arms, "rule": RULE},
        "cells": cells,
        "min_ratio": low[2] if low else None,
        "min_at": {"preset": low[0]["preset"], "shape": low[0]["shape"], "similarity": low[0]["similarity"],
                   "arm": low[1]} if low else None,
        "below_rule": [{"preset": c["preset"], "shape": c["shape"], "similarity": c["similarity"], "arm": arm, "ratio": r}
                       for c, arm, r in ratios if r < RULE],
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"lowest ratio {out['min_ratio']} at {out['min_at']}; below {RULE}: {len(out['below_rule'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
