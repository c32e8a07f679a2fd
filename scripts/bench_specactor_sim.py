"""SpecActor's ablation in the simulator (section 5.4, Figure 13), coupled execution.

A 32B target on ``h100-32b`` instances (TP4 each, as the paper's traces), a long-tail synthetic
workload, and draft-model methods through ``verl_ext.sim.synthetic.SyntheticDrafter`` (per-request
acceptance per method; the draft models' time from their cost models). Arms:

* ``baseline``: plain decoding (veRL);
* ``vanilla``: every request drafts with one method (``--vanilla``) at one fixed window, the
  ladder's best at the initial per-instance batch (VanillaSpec: vLLM's coupled speculation);
* ``decoupled``: the same method with its draft model on a GPU of its own per instance, at the
  best decoupled window (TGS model); one drafter GPU per TP-4 verifier means 4/5 of the
  instances for the same GPUs (``SyntheticDrafter(decoupled=True)``);
* ``specactor`` without Best-of-N and reconfiguration (decoupled, same GPUs): the ladder's initial
  selection, its window per request at the step's per-instance batch;
* ``+ reconfiguration``: Algorithm 2 on running requests;
* ``+ Best-of-N``: Algorithm 3's copies on freed instances (greedy: copies are lossless).

Prints a table and writes JSON. ``--preset`` (the verifier) and ``--drafter NAME=COST_MODEL``
(a draft model's, e.g. ``qwen0.5b=runs/gpu/profile_dummy.json`` from ``scripts/gpu_check.sh
--config-only``) take presets or ``verl-ext fit grid`` JSONs, so measured step times replace the
roofline presets; ``--acceptance NAME=P`` replaces a method's assumed mean acceptance (measured
rates, or a sensitivity sweep: docs/BENCHMARKS.md).

    python scripts/bench_specactor_sim.py --instances 16 --prompts 128 --samples 16 --out runs/bench_specactor_sim.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path


from verl_ext.compare.run import run_strategy
from verl_ext.pipe import make_strategy
from verl_ext.sim.clock import run_virtual
from verl_ext.perf.cost import load_cost_model
from verl_ext.sim.instance import SimInstance
from verl_ext.sim.runner import SimConfig, build_requests, load_workload, select_epoch
from verl_ext.sim.source import TraceSource
from verl_ext.sim.synthetic import SyntheticDrafter, SyntheticMethod
from verl_ext.spec import SpecOptions
from verl_ext.spec.ladder import DraftLadder, DraftMethod
from verl_ext.spec.tgs import DECOUPLED

#: the paper's methods for a 32B target (section 5.1); rates as in the ladder figures of
#: docs/BENCHMARKS.md (assumed: model rates are not measurable here)
METHODS = (("qwen0.5b", "h100-0.5b", 0.6), ("qwen1.5b", "h100-1.5b", 0.7))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="h100-32b")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--mean-len", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=20480)
    ap.add_argument("--spec-k", type=int, default=16)
    ap.add_argument("--concentration", type=float, default=4.0, help="Beta concentration of per-request rates")
    ap.add_argument("--vanilla", default="qwen0.5b", help="VanillaSpec's method (the paper: 0.5B)")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=COST_MODEL",
                    help=f"a method's draft-model cost model (preset or profile JSON); methods and defaults: "
                         f"{', '.join(f'{n}={d}' for n, d, _ in METHODS)}")
    ap.add_argument("--acceptance", action="append", default=[], metavar="NAME=P",
                    help="a method's mean per-token acceptance instead of the assumed default "
                         f"({', '.join(f'{n}={p}' for n, _, p in METHODS)}); the ladder and the synthetic rates use it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_specactor_sim.json")
    args = ap.parse_args(argv)

    drafters = {n: d for n, d, _ in METHODS}
    for item in args.drafter:
        name, sep, model = item.partition("=")
        if not sep or name not in drafters:
            ap.error(f"--drafter wants NAME=COST_MODEL with NAME one of {', '.join(drafters)}, got '{item}'")
        drafters[name] = model
    rates = {n: p for n, _, p in METHODS}
    for item in args.acceptance:
        name, sep, val = item.partition("=")
        try:
            p = float(val)
        except ValueError:
            p = -1.0
        if not sep or name not in rates or not 0.0 <= p <= 1.0:
            ap.error(f"--acceptance wants NAME=P with NAME one of {', '.join(rates)} and P in [0, 1], got '{item}'")
        rates[name] = p
    cost = load_cost_model(args.preset)
    methods = [DraftMethod(n, "model", rates[n], drafter=drafters[n]) for n, _, _ in METHODS]
    synth = {m.name: SyntheticMethod(m.acceptance, args.concentration, load_cost_model(m.drafter)) for m in methods}
    ladder = DraftLadder.build(cost, methods, max_window=args.spec_k)
    tmp = Path(tempfile.mkdtemp()) / "ladder.json"
    ladder.save(tmp)

    cfg = SimConfig(synth=dict(prompts=args.prompts, samples=args.samples, mean_len=args.mean_len,
                               max_len=args.max_len), similarity="published", seed=args.seed)
    trace = load_workload(cfg)
    _, rows, _ = select_epoch(trace)
    source = TraceSource(trace, rows)
    reqs = build_requests(trace, rows, int(trace.response_lengths()[rows].max()))
    # greedy: Best-of-N copies are lossless only with identical sampling (the strategy refuses
    # copies of sampled requests); the simulated tokens are the trace's either way
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, temperature=0.0)) for r in reqs]
    per = -(-len(reqs) // args.instances)
    w_van = ladder.best_window(args.vanilla, ladder.methods[args.vanilla].acceptance, per)
    n_dec = max(1, args.instances * 4 // 5)  # one drafter GPU beside each TP-4 verifier
    per_dec = -(-len(reqs) // n_dec)
    times = ladder.methods[args.vanilla].times(cost)
    w_dec, _ = times.best_window(ladder.methods[args.vanilla].acceptance, per_dec, DECOUPLED, g_d=1, w_max=args.spec_k)
    spec = SpecOptions(scopes="request", k=args.spec_k)
    opts = {"ladder": str(tmp), "model_methods": True, "spec_k": args.spec_k, "min_tokens": 64}
    # (label, strategy, options, drafting, decoupled, window for the baseline strategy)
    arms = [
        ("baseline", "baseline", {}, False, False, None),
        (f"vanilla, coupled ({args.vanilla}, w={w_van})", "baseline", {}, True, False, w_van),
        (f"decoupled ({args.vanilla}, w={w_dec}, {n_dec} instances)", "baseline", {}, True, True, w_dec),
        ("specactor, decoupled, no reconfig., no Best-of-N", "specactor",
         {"reconfigure": False, "best_of_n": False, "execution": "decoupled"}, True, True, None),
        ("+ reconfiguration (Algorithm 2)", "specactor", {"best_of_n": False, "execution": "decoupled"}, True, True, None),
        ("+ reconfiguration, per-request modes", "specactor",
         {"best_of_n": False, "execution": "decoupled", "switch_modes": True}, True, True, None),
        ("+ Best-of-N (Algorithm 3)", "specactor", {"execution": "decoupled"}, True, True, None),
        ("specactor, coupled (all on)", "specactor", {}, True, False, None),
    ]
    out = {"config": vars(args), "requests": len(reqs), "per_instance": per,
           "response_tokens": int(trace.response_lengths()[rows].sum()), "arms": {}}
    base = None
    print(f"{len(reqs)} requests on {args.instances} x {args.preset} ({per} per instance), "
          f"{out['response_tokens']:,} tokens; methods {', '.join(f'{n}@{rates[n]} ({drafters[n]})' for n, _, _ in METHODS)}")
    for label, name, extra, drafts, decoupled, window in arms:
        t0 = time.perf_counter()
        st = make_strategy(name, {**opts, **extra} if name == "specactor" else {})
        # as `verl-ext ab`: engines draft only where the strategy asks for a drafter (specactor
        # decodes plainly when no method pays even for a lone request)
        drafts = drafts and (name != "specactor" or st.engine_spec(cost) is not None)
        drafter = SyntheticDrafter(spec, synth, args.vanilla, seed=args.seed, decoupled=decoupled) if drafts else None
        n = n_dec if decoupled else args.instances
        sims = [SimInstance(f"sim-{i}", cost, source, drafter, record_timeline=False) for i in range(n)]
        rq = reqs
        if window is not None:
            rq = [dataclasses.replace(r, extra={**r.extra, "spec_method": args.vanilla, "spec_window": window}) for r in reqs]

        async def go(st=st, sims=sims, rq=rq):
            import asyncio

            loop = asyncio.get_running_loop()
            return await run_strategy(st, sims, rq, lambda r, t: 0.0, clock=loop.time, sample_telemetry=False)

        arm = run_virtual(go())
        for r, c in zip(rq, arm.completions):
            if len(c.token_ids) != len(source.target(r).tokens):
                raise AssertionError(f"{label}: {r.request_id} lost tokens")
        m = arm.metrics
        base = base or m["wall_s"]
        row = {"instances": n, "wall_s": m["wall_s"], "vs_baseline": base / m["wall_s"], "tail_s": m.get("tail_s"),
               "tokens_per_step": m.get("tokens_per_step"), "draft_tokens": m.get("draft_tokens"),
               "strategy": {k: v for k, v in st.metrics().items() if k in ("bon_copies", "bon_wins", "reconfigured_running",
                                                                      "selected_method", "selected_speedup", "switched_coupled",
                                                                      "switched_decoupled")},
               "sim_s": time.perf_counter() - t0}
        out["arms"][label] = row
        print(f"{label:<45} {row['wall_s']:9.1f} s  {row['vs_baseline']:.3f}x  tail {row['tail_s'] or 0:7.1f} s  "
              f"tok/step {row['tokens_per_step'] or 1:.2f}  {row['strategy']}  ({row['sim_s']:.0f} s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
