"""RLHFSpec's Table 1 in the simulator: the workload-aware selection's throughput as a percentage
of the best fixed draft length n in 2..48, at sample counts 8..64 on one instance.

Each run keeps exactly S samples in flight on one simulated instance (a finished sample is
replaced at once from the workload) and measures tokens per second until the workload runs dry
(after that the batch shrinks below S). Every arm drafts from the same suffix trees (request and
group scopes, exact per-step replay): fixed n = up to n tokens per request and step
(``min_prob=0``); ``select`` = candidates of up to 48 tokens cut by ``verl_ext.spec.select``.
The selection's decision time per step is recorded next to the simulated step time.

    python scripts/bench_rlhfspec.py --preset h100-7b --out runs/bench_rlhfspec_synth.json
    python scripts/bench_rlhfspec.py --preset h100-7b --trace data/traces/smollm2_arith_e2.parquet \
        --per-slot 2 --out runs/bench_rlhfspec_trace.json
    verl-ext fit acceptance data/traces/smollm2_arith_e2.parquet@0 --out runs/F_smollm2_e0.json
    python scripts/bench_rlhfspec.py --preset h100-7b --trace data/traces/smollm2_arith_e2.parquet \
        --acceptance runs/F_smollm2_e0.json --per-slot 2 --out runs/bench_rlhfspec_trace_fitted.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


FIXED_N = (2, 4, 8, 16, 24, 32, 40, 48)
SAMPLE_COUNTS = (8, 16, 24, 32, 40, 48, 56, 64)


def run_one(spec, cost, trace, rows, samples: int, per_slot: int):
    from verl_ext.sim.clock import run_virtual
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.workload import build_requests
    from verl_ext.sim.source import TraceSource

    source = TraceSource(trace, rows)
    drafter = make_drafter(spec, source, "exact") if spec is not None else None
    inst = SimInstance("sim-0", cost, source, drafter, record_timeline=False)
    reqs = build_requests(trace, rows, int(trace.response_lengths()[rows].max()))[: samples * per_slot]
    queue = list(reversed(reqs))
    mark = {}

    async def slot():
        loop = asyncio.get_running_loop()
        while queue:
            r = queue.pop()
            if not queue and "t" not in mark:  # the last sample is in: from here the batch shrinks
                mark["t"], mark["tokens"] = loop.time(), inst.telemetry().generated_tokens
            await inst.generate(r)

    async def main():
        await asyncio.gather(*[slot() for _ in range(samples)])

    t = time.perf_counter()
    run_virtual(main())
    wall = time.perf_counter() - t
    out = {"tok_s": mark["tokens"] / mark["t"], "tokens_per_step": inst.counters.generated_tokens / max(1, inst.counters.request_steps),
           "sim_s": wall, "steps": inst.counters.steps, "busy_s": inst.busy_s}
    if inst.selector is not None:
        st = inst.selector.stats()
        out.update(st)
        out["select_ms_per_step"] = 1e3 * st["select_s"] / max(1, st["select_steps"])
        out["select_overhead"] = st["select_s"] / inst.busy_s  # decision time / simulated step time
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="h100-7b")
    ap.add_argument("--trace", default=None, help="a trace (default: the synthetic scenario at published similarity)")
    ap.add_argument("--prompts", type=int, default=64, help="synthetic workload: prompts (x 16 samples)")
    ap.add_argument("--mean-len", type=int, default=1024, help="synthetic workload: mean response length")
    ap.add_argument("--per-slot", type=int, default=4, help="samples per slot (workload = S x this)")
    ap.add_argument("--counts", default=",".join(map(str, SAMPLE_COUNTS)))
    ap.add_argument("--fixed", default=",".join(map(str, FIXED_N)))
    ap.add_argument("--scopes", default="request+group")
    ap.add_argument("--acceptance", default="", help="F's offline fit (verl-ext fit acceptance JSON) as the selector's prior")
    ap.add_argument("--out", default="runs/bench_rlhfspec.json")
    args = ap.parse_args()

    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.runner import SimConfig, load_workload, select_epoch
    from verl_ext.spec import SpecOptions

    cost = load_cost_model(args.preset)
    if args.trace:
        from verl_ext.trace.format import read_trace

        trace = read_trace(args.trace)
    else:
        trace = load_workload(SimConfig(synth=dict(prompts=args.prompts, samples=16, mean_len=args.mean_len,
                                                   max_len=4 * args.mean_len), similarity="published"))
    _, rows, _ = select_epoch(trace)
    counts = [int(x) for x in args.counts.split(",")]
    fixed = [int(x) for x in args.fixed.split(",")]
    arms = {f"n={n}": SpecOptions(scopes=args.scopes, k=n, min_prob=0.0) for n in fixed}
    arms["select"] = SpecOptions(scopes=args.scopes, k=max(fixed), min_prob=0.0, select=True, acceptance=args.acceptance)
    arms["plain"] = None
    table = []
    for s in counts:
        if s * args.per_slot > len(rows):
            raise SystemExit(f"the workload has {len(rows)} samples; {s} x {args.per_slot} needed")
        res = {name: run_one(spec, cost, trace, rows, s, args.per_slot) for name, spec in arms.items()}
        best_name = max((n for n in res if n.startswith("n=")), key=lambda n: res[n]["tok_s"])
        row = {"samples": s, "best_fixed": best_name, "best_fixed_tok_s": res[best_name]["tok_s"],
               "select_tok_s": res["select"]["tok_s"], "plain_tok_s": res["plain"]["tok_s"],
               "select_vs_best": res["select"]["tok_s"] / res[best_name]["tok_s"],
               "select_ms_per_step": res["select"]["select_ms_per_step"],
               "select_overhead": res["select"]["select_overhead"], "arms": res}
        table.append(row)
        print(f"S={s:3d}  best fixed {best_name:5s} {row['best_fixed_tok_s']:9.0f} tok/s  select "
              f"{row['select_tok_s']:9.0f} ({100 * row['select_vs_best']:5.1f}%)  plain {row['plain_tok_s']:9.0f}  "
              f"decision {row['select_ms_per_step']:.3f} ms/step ({100 * row['select_overhead']:.2f}% of step time)",
              flush=True)
    worst = min(r["select_vs_best"] for r in table)
    print(f"worst case: {100 * worst:.1f}% of the best fixed n")
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "acceptance": args.acceptance, "trace": args.trace or f"synthetic published {args.prompts}x16 mean {args.mean_len}",
                   "per_slot": args.per_slot, "worst": worst, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
