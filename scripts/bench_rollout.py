"""Rollout throughput of the default model on local vLLM engines, per instance count.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_rollout.py [--instances 1,2] [--strategies baseline]
        [--prompts 16] [--samples 4] [--max-tokens 192] [--dtypes auto] [--out runs/bench_rollout]

Runs `verl-ext ab` once per instance count and engine dtype (same prompts and seeds), prints
output tokens/s in total and per instance, and writes `<out>/bench_rollout.json` (each run's
summary.json is kept under `<out>/instances_<k>[_<dtype>]/`). `--dtypes auto` is what the engines
use by default (`verl_ext.vllm.local.cpu_default_dtype`); e.g. `--dtypes bfloat16,float32`
compares the two on one machine.
"""

import argparse
import json
import sys
from pathlib import Path

from verl_ext.compare.outputs import format_table
from verl_ext.ab.runner import ABConfig, run_ab


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--instances", default="1,2")
    p.add_argument("--strategies", default="baseline")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="auto", help="comma-separated engine dtypes: auto (the default) or a vLLM dtype")
    p.add_argument("--out", default="runs/bench_rollout")
    args = p.parse_args(argv)
    out = Path(args.out)
    results = {}
    for k in [int(x) for x in args.instances.split(",")]:
        for dtype in args.dtypes.split(","):
            tag = f"instances_{k}" + ("" if dtype == "auto" else f"_{dtype}")
            cfg = ABConfig(strategies=args.strategies.split(","), prompts=args.prompts, samples=args.samples,
                           max_tokens=args.max_tokens, instances=k, seed=args.seed, out=str(out / tag))
            summary = run_ab(cfg, progress=False, engine_args=None if dtype == "auto" else {"dtype": dtype})
            print(f"\n== {k} instance(s), dtype {summary['config']['engine'].get('dtype', 'model')}\n{format_table(summary)}")
            results[(k, dtype)] = summary
    rows = []
    for (k, _), summary in results.items():
        for name, m in summary["strategies"].items():
            rows.append({"instances": k, "dtype": summary["config"]["engine"].get("dtype", "model"),
                         "strategy": name, "throughput_tok_s": m["throughput_tok_s"],
                         "per_instance_tok_s": m["throughput_tok_s"] / k, "wall_s": m["wall_s"],
                         "tail_s": m["tail_s"], "output_tokens": m["output_tokens"], "mean_reward": m["mean_reward"]})
    print("\ninstances  dtype     strategy   tok/s  tok/s/instance  wall s  tail s")
    for r in rows:
        print(f"{r['instances']:9d}  {r['dtype']:8s}  {r['strategy']:9s} {r['throughput_tok_s']:6.1f}  {r['per_instance_tok_s']:14.1f}"
              f"  {r['wall_s']:6.2f}  {r['tail_s']:6.2f}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rollout.json").write_text(json.dumps({"rows": rows, "argv": vars(args),
                                                         "machine": next(iter(results.values()))["machine"]}, indent=2))
    print(f"\nwrote {out / 'bench_rollout.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
