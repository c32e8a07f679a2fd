"""Every strategy's mechanisms in the simulator (``verl-ext sim``'s ``run_sim_ab``), each arm
under the conditions that make its mechanisms act: seer on a tight KV budget with small chunks,
rlhfspec with a group's samples placed together and a low turning point, the workload taken as
recorded greedy (``meta["temperature"] = 0``: specactor's Best-of-N copies only greedy requests),
``exact`` replay (drafts attributed to the scope that proposed them). Prints JSON: per arm, how
many times each mechanism acted (``verl_ext.pipe.mechanisms``). Counts, not timings.

    OMP_NUM_THREADS=1 python scripts/bench_mechanisms_sim.py --out runs/mech_sim
"""

from __future__ import annotations

import argparse
import json

ARMS = ["baseline", "seer[kv_fraction=0.002,chunk_size=64]", "rhyme",
        "rlhfspec[allocation=grouped,threshold=6,cooldown=1]", "specactor"]


def main() -> None:
    from verl_ext.sim.runner import SimConfig, load_workload, run_sim_ab

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--out", default="runs/mech_sim")
    args = ap.parse_args()
    cfg = SimConfig(strategies=ARMS, synth=dict(prompts=args.prompts, samples=args.samples, mean_len=256, max_len=1024),
                    instances=args.instances, replay="exact", out=args.out)
    trace = load_workload(cfg)
    trace.meta["temperature"] = 0.0
    summary = run_sim_ab(cfg, progress=False, trace=trace)
    print(json.dumps({arm: m["mechanisms"] for arm, m in summary["strategies"].items()}, indent=1))


if __name__ == "__main__":
    main()
