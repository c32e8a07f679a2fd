"""Does the simulator predict the real runs? (issue 49 part 4)

For one workload, every strategy's wall time relative to ``baseline`` measured on real engines
(``verl-ext ab``) and predicted by the simulator (``verl-ext sim --trace``) from a trace of the
same rollout, side by side:

1. **real**: ``verl-ext ab`` in the realistic setting (sampled at ``--temperature``, keyed
   sampling, two epochs so history-driven strategies draft from the first, ``--repeats`` rounds
   with the arms rotated); ``real_ratio`` is the median round's last-epoch wall time over
   ``baseline``'s, ``real_spread`` the rounds' range. ``--ab SUMMARY.json`` reuses a finished
   run's ``summary.json`` instead (the workload flags then come from it).
2. **trace**: ``verl-ext trace record`` of the same requests (same prompts, per-request seeds and
   keyed sampling), so every strategy's responses are the trace's (keyed sampling makes them
   identical across strategies; ``ab`` checks that). ``--trace T.parquet`` reuses one; its
   workload must match.
3. **sim**: the trace's last epoch, the earlier one as history, on as many simulated instances as
   real engines, with this machine's shipped cost model (``cpu-smollm2``, or ``--preset``) held
   to the real engines' limits (``max_num_seqs``, token budget, KV block size) and no veRL
   dispatcher (``verl-ext ab`` has none). The earlier epoch is rolled out first, untimed, and the
   timed epoch's instances keep what its drafters learned (``--warm-epochs``), as ``ab``'s
   engines serve both epochs; ``sim_ratio`` the same quotient.

**The veRL path** (``--verl DIR``: a finished ``bash scripts/verl_e2e.sh --trace`` run, with
``baseline``): each strategy's training run recorded its own rollouts, one trace per step, and
its dispatcher's ``rollout_s`` per step. Each step ``k`` from the second on is simulated from that
run's own trace (steps before ``k``: history, and rolled out first on the same instances), with
veRL's dispatcher, the CPU mode's float32 cost model (``cpu-smollm2-avx2``) and as many instances
as the run had servers. ``real_ratio`` is the median over steps of ``rollout_s`` over
``baseline``'s at the same step, ``sim_ratio`` the same quotient of the predictions (each run's
own workload on both sides: the policies, hence the responses, differ between runs).

Prints one JSON object: ``rows`` (one per strategy and path: ``real_ratio``, ``sim_ratio``,
``error`` = sim / real - 1, ``band``, ``within``; ``baseline``'s row compares absolute wall
times) and the commands and workload behind them. A path not run is listed under ``not_run``.

    python scripts/bench_sim_vs_real.py --json                  # ~30 min on a 2-core CPU
    python scripts/bench_sim_vs_real.py --json --quick          # a smaller version for checks
    python scripts/bench_sim_vs_real.py --json --ab runs/realistic/summary.json
    python scripts/bench_sim_vs_real.py --json --no-ab --verl runs/verl_t07   # the veRL path only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

STRATEGIES = "baseline,seer,rhyme,rlhfspec,specactor"
#: issue 49 part 4's bands, relative error of the ratio per path
BANDS = {"ab": 0.10, "verl": 0.15}
#: the workload flags a trace must share with the ab run it stands for
WORKLOAD_KEYS = ("prompts", "samples", "max_tokens", "instances", "seed", "temperature", "difficulty", "keyed_sampling")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--quick", action="store_true", help="small workload, one round, baseline and seer (a check, not a figure)")
    p.add_argument("--strategies", default=None, help=f"comma-separated strategies (default: {STRATEGIES})")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ab", default=None, help="a finished `verl-ext ab` run's summary.json instead of running one")
    p.add_argument("--trace", default=None, help="a recorded trace of the same workload instead of recording one")
    p.add_argument("--preset", default=None, help="the simulator's cost model (default: this machine's shipped CPU preset)")
    p.add_argument("--verl", default=None, help="a finished `scripts/verl_e2e.sh --trace` run's directory: the veRL path")
    p.add_argument("--no-ab", action="store_true", help="skip the ab path (with --verl)")
    p.add_argument("--out", default="runs/sim_vs_real", help="directory for the ab run, the trace and the sim run")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_tokens, args.repeats = 4, 4, 64, 1
        args.strategies = args.strategies or "baseline,seer"
    args.strategies = args.strategies or STRATEGIES
    if args.no_ab and not args.verl:
        p.error("--no-ab leaves nothing to compare without --verl")
    return args


def say(args, msg: str) -> None:
    print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)


def real_ab(args, out: Path) -> dict:
    """The real run's summary: loaded from ``--ab``, else run now."""
    if args.ab:
        return json.loads(Path(args.ab).read_text())
    from verl_ext.ab.runner import ABConfig, run_ab

    cfg = ABConfig(strategies=args.strategies.split(","), prompts=args.prompts, samples=args.samples,
                   max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, epochs=2,
                   repeats=args.repeats, keyed_sampling=True, out=str(out / "ab"), engine_log=str(out / "engines.log"))
    say(args, f"real: verl-ext ab ({cfg.repeats} round(s) of {len(cfg.strategies)} arms)")
    return run_ab(cfg, progress=not args.json)


def workload_of(summary: dict) -> dict:
    cfg = summary["config"]
    return {k: cfg[k] for k in WORKLOAD_KEYS} | {"epochs": cfg["epochs"], "dtype": cfg.get("engine", {}).get("dtype")}


def trace_for(args, work: dict, out: Path) -> str:
    """A trace of the ab run's requests: ``--trace`` (checked against the workload), else recorded."""
    from verl_ext.trace import read_trace

    if args.trace:
        have = read_trace(args.trace).meta["config"]
        wrong = {k: (have.get(k), work[k]) for k in (*WORKLOAD_KEYS, "epochs", "dtype") if have.get(k) != work[k]}
        if wrong:
            raise SystemExit(f"--trace {args.trace} is another workload than the ab run: {wrong} (trace, ab)")
        return args.trace
    from verl_ext.ab.record import RecordConfig, record_trace

    path = str(out / "trace.parquet")
    say(args, f"trace: verl-ext trace record -> {path}")
    record_trace(RecordConfig(prompts=work["prompts"], samples=work["samples"], epochs=work["epochs"],
                              max_tokens=work["max_tokens"], instances=work["instances"], seed=work["seed"],
                              temperature=work["temperature"], difficulty=work["difficulty"],
                              keyed_sampling=work["keyed_sampling"], dtype=work["dtype"], out=path,
                              engine_log=str(out / "trace_engines.log")), progress=not args.json)
    return path


def simulate(args, summary: dict, trace: str, out: Path) -> dict:
    from verl_ext.ab.runner import cpu_default_preset
    from verl_ext.perf.cost import ENGINE_ARG_FIELDS
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    cfg = summary["config"]
    budget = cfg["max_tokens"]  # one per epoch where ab ran with a list: the timed (last) epoch's
    # the real engines' limits (their max_num_seqs and token budget, a block_size the run set)
    limits = {k: v for k, v in cfg.get("engine", {}).items() if k in ENGINE_ARG_FIELDS}
    sim = SimConfig(strategies=list(summary["strategies"]), trace=trace, preset=args.preset or cfg.get("preset") or cpu_default_preset(),
                    instances=cfg["instances"], spec_k=cfg["spec_k"], seed=cfg["seed"], max_tokens=budget[-1] if isinstance(budget, list) else budget,
                    dispatcher=False, warm_epochs=True, engine_args=limits, out=str(out / "sim"))
    say(args, f"sim: verl-ext sim --trace {trace} --preset {sim.preset} --instances {sim.instances} --no-dispatcher --warm-epochs"
              + "".join(f" --engine-arg {k}={v}" for k, v in limits.items()))
    return run_sim_ab(sim, progress=False)


def same_lengths(args, out: Path, trace: str):
    """``[same, of]``: ab's baseline responses (its ``requests.jsonl``, median round, last epoch)
    whose lengths the trace's last epoch repeats; None where the ab run's files are not beside it."""
    from verl_ext.trace import read_trace

    rows = Path(args.ab).parent / "requests.jsonl" if args.ab else out / "ab" / "requests.jsonl"
    if not rows.exists():
        return None
    real = {r["request_id"]: r["output_tokens"] for r in map(json.loads, rows.read_text().splitlines())
            if r["strategy"] == "baseline"}
    t = read_trace(trace)
    last = t.epoch == t.epoch.max()
    lengths = t.response_lengths()
    traced = {f"{u}-s{j}": int(n) for u, j, n in zip(t.prompt_uid[last], t.sample_index[last], lengths[last])}
    return [sum(traced.get(k) == n for k, n in real.items()), len(real)]


def rows_for(real: dict, sim: dict) -> list[dict]:
    rs, ss = real["strategies"], sim["strategies"]
    base_real = rs["baseline"]["wall_s"]
    base_sim = ss["baseline"]["wall_s"]
    rows = []
    for name, m in rs.items():
        rounds = (m.get("repeats") or {}).get("wall_vs_baseline") or [m["wall_s"] / base_real]
        real_ratio = (m.get("repeats") or {}).get("wall_vs_baseline_median", m["wall_s"] / base_real)
        row = {"path": "ab", "strategy": name, "real_wall_s": round(m["wall_s"], 3), "sim_wall_s": round(ss[name]["wall_s"], 3),
               "real_tokens_per_step": m.get("tokens_per_step"), "sim_tokens_per_step": ss[name].get("tokens_per_step")}
        if name == "baseline":  # the ratio is 1 on both sides; what it shows is the cost model's absolute error
            row.update(real_ratio=1.0, sim_ratio=1.0, error=None, wall_error=round(base_sim / base_real - 1, 4))
        else:
            sim_ratio = ss[name]["wall_s"] / base_sim
            row.update(real_ratio=round(real_ratio, 4), real_spread=[round(min(rounds), 4), round(max(rounds), 4)],
                       sim_ratio=round(sim_ratio, 4), error=round(sim_ratio / real_ratio - 1, 4), band=BANDS["ab"])
            row["within"] = abs(row["error"]) <= BANDS["ab"]
        rows.append(row)
    return rows


def verl_rows(args, out: Path) -> tuple[list[dict], dict]:
    """The veRL path's rows (see the module docstring) and what each strategy's were made of."""
    from verl_ext.verl_runs.e2e import CPU_PROFILE, servers_of
    from verl_ext.sim.runner import SimConfig, run_sim_ab
    from verl_ext.trace import Trace, read_trace, write_trace

    root = Path(args.verl)
    runs = {}
    for name in args.strategies.split(","):
        run_dir = root / name
        if not (run_dir / "summary.json").is_file():
            continue
        real = json.loads((run_dir / "summary.json").read_text())["rollout_s"]
        files = sorted((run_dir / "traces").glob("step_*.parquet"), key=lambda f: int(f.stem.split("_")[1]))
        if not files:
            raise SystemExit(f"{run_dir}: no traces; run scripts/verl_e2e.sh with --trace")
        steps = Trace.concat([read_trace(f) for f in files])
        path = out / "verl_sim" / name / "steps.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_trace(steps, path)
        servers = servers_of((run_dir / "command.txt").read_text().split())  # the trainer command's
        sim = {}
        for k in sorted(int(e) for e in steps.epochs())[1:]:
            cfg = SimConfig(strategies=[name], trace=str(path), preset=args.preset or CPU_PROFILE, instances=servers,
                            epoch=k, max_tokens=steps.meta.get("response_length"), seed=args.seed,
                            dispatcher=True, warm_epochs=True, out=str(path.parent / f"step_{k}"))
            sim[k] = run_sim_ab(cfg, progress=False)["strategies"][name]["wall_s"]
        runs[name] = {"real": {k: real[k - 1] for k in sim if k - 1 < len(real) and real[k - 1]}, "sim": sim,
                      "servers": servers, "trace": str(path)}
        say(args, f"verl: {name}: real rollout_s {runs[name]['real']}, simulated {sim}")
    if "baseline" not in runs:
        raise SystemExit(f"{root}: no baseline run to compare with")
    base = runs["baseline"]
    rows = []
    for name, r in runs.items():
        steps = sorted(set(r["real"]) & set(base["real"]) & set(r["sim"]))
        row = {"path": "verl", "strategy": name, "steps": steps,
               "real_rollout_s": [round(r["real"][k], 3) for k in steps], "sim_rollout_s": [round(r["sim"][k], 3) for k in steps]}
        if name == "baseline":
            row.update(real_ratio=1.0, sim_ratio=1.0, error=None,
                       wall_error=round(float(np.median([r["sim"][k] / r["real"][k] for k in steps])) - 1, 4))
        else:
            real_q = [r["real"][k] / base["real"][k] for k in steps]
            sim_q = [r["sim"][k] / base["sim"][k] for k in steps]
            row.update(real_ratio=round(float(np.median(real_q)), 4), real_spread=[round(min(real_q), 4), round(max(real_q), 4)],
                       sim_ratio=round(float(np.median(sim_q)), 4))
            row["error"] = round(row["sim_ratio"] / row["real_ratio"] - 1, 4)
            row.update(band=BANDS["verl"], within=abs(row["error"]) <= BANDS["verl"])
        rows.append(row)
    return rows, {n: {k: v for k, v in r.items() if k in ("servers", "trace")} for n, r in runs.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result: dict = {"bench": "sim_vs_real", "quick": args.quick, "rows": [], "not_run": {}, "bands": BANDS}
    if args.no_ab:
        result["not_run"]["ab"] = "--no-ab"
    else:
        result.update(ab_path(args, out))
    if args.verl:
        rows, runs = verl_rows(args, out)
        result["rows"] += rows
        result["verl"] = {"dir": args.verl, "runs": runs}
    else:
        result["not_run"]["verl"] = "no --verl run given (bash scripts/verl_e2e.sh --trace ...)"
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def ab_path(args, out: Path) -> dict:
    """The ``ab`` path: its rows and what they were made of."""
    real = real_ab(args, out)
    if "baseline" not in real["strategies"]:
        raise SystemExit("the ab run has no baseline arm")
    work = workload_of(real)
    if not work["keyed_sampling"] and work["temperature"] > 0:
        raise SystemExit("the ab run sampled without keyed sampling: its arms' responses differ, no one trace stands for them")
    trace = trace_for(args, work, out)
    sim = simulate(args, real, trace, out)
    # the trace must be the rollout the arms made: ab's baseline responses, request by request
    same = same_lengths(args, out, trace)
    real_tokens = real["strategies"]["baseline"]["output_tokens"]
    sim_tokens = sim["workload"]["response_tokens"]
    return {
        "workload": work,
        "tokens": {"real": real_tokens, "trace": sim_tokens, "same": real_tokens == sim_tokens, "same_lengths": same},
        "preset": sim["config"]["preset"],
        "engine_args": sim["config"]["engine_args"],  # the real engines' limits the simulated ones kept
        "rows": rows_for(real, sim),
        "outputs": {"ab": args.ab or str(out / "ab"), "trace": trace, "sim": str(out / "sim")},
        "machine": real.get("machine"),
    }


if __name__ == "__main__":
    raise SystemExit(main())
