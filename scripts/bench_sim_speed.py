"""How long the simulator takes, per strategy, and whether a seed gives the same figures every
run (issue 49 part 7).

Runs ``verl-ext sim``'s default scenario (or a smaller one: ``--prompts``) for each strategy
``--repeats`` times in this process, one arm at a time, and prints JSON: per strategy the
simulator's own seconds per run (``sim_seconds``: draft replay and selection included), the
simulated rollout's wall time and output tokens per run, and ``deterministic`` (every run gave
the same simulated wall time, tokens and tokens per step). Pin one thread
(``OMP_NUM_THREADS=1``); nothing else should run beside it.

``--jobs N`` then also runs every strategy in one ``run_sim_ab`` call with ``N`` worker
processes (``verl-ext sim --jobs N``) and prints its wall time under ``together``, with
``same_figures``: whether each strategy's figures equal its runs alone.

    OMP_NUM_THREADS=1 python scripts/bench_sim_speed.py --json
    OMP_NUM_THREADS=1 python scripts/bench_sim_speed.py --json --prompts 16 --strategies rlhfspec
    OMP_NUM_THREADS=1 python scripts/bench_sim_speed.py --json --repeats 1 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

STRATEGIES = "baseline,seer,rhyme,rlhfspec,specactor"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--strategies", default=STRATEGIES)
    p.add_argument("--prompts", type=int, default=None, help="prompts of the synthetic scenario (default: the default scenario's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=None,
                   help="also run all strategies in one run with this many worker processes (default: not)")
    args = p.parse_args(argv)
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    synth = {"prompts": args.prompts} if args.prompts else {}
    rows = {}
    t0 = time.monotonic()
    for name in args.strategies.split(","):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                s = run_sim_ab(SimConfig(strategies=[name], synth=synth, seed=args.seed, out=out), progress=False)
            m = s["strategies"][name]
            runs.append({"sim_seconds": round(m["sim_seconds"], 2), "wall_s": m["wall_s"], "output_tokens": m["output_tokens"],
                         "tokens_per_step": m["tokens_per_step"]})
            if not args.json:
                print(f"{name}: {runs[-1]}", file=sys.stderr, flush=True)
        same = all({k: r[k] for k in ("wall_s", "output_tokens", "tokens_per_step")} ==
                   {k: runs[0][k] for k in ("wall_s", "output_tokens", "tokens_per_step")} for r in runs)
        rows[name] = {"sim_seconds": [r["sim_seconds"] for r in runs], "wall_s": runs[0]["wall_s"],
                      "output_tokens": runs[0]["output_tokens"], "deterministic": same}
    result = {"bench": "sim_speed", "scenario": {"prompts": args.prompts or "default", "seed": args.seed},
              "repeats": args.repeats, "strategies": rows,
              "total_sim_seconds_one_run": round(sum(min(r["sim_seconds"]) for r in rows.values()), 1)}
    if args.jobs:
        names = args.strategies.split(",")
        t1 = time.monotonic()
        with tempfile.TemporaryDirectory() as out:
            s = run_sim_ab(SimConfig(strategies=names, synth=synth, seed=args.seed, out=out), progress=False,
                           jobs=args.jobs)
        wall = time.monotonic() - t1
        same = all({"wall_s": s["strategies"][n]["wall_s"], "output_tokens": s["strategies"][n]["output_tokens"]} ==
                   {"wall_s": rows[n]["wall_s"], "output_tokens": rows[n]["output_tokens"]} for n in names)
        result["together"] = {"jobs": args.jobs, "wall_s": round(wall, 1), "same_figures": same,
                              "sim_seconds": {n: round(s["strategies"][n]["sim_seconds"], 1) for n in names}}
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
