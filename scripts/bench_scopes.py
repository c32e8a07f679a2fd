"""What each drafting scope is worth on real rollouts, alone and together (issue 51, parts 1
and 4): exact-match replay of a trace's last epoch (``verl_ext.trace.synth.similarity.scope_replay``) for
every scope, every pair and all four, and how much each pair overlaps.

A scope set's gain is ``g = MAL - 1``, the draft tokens it adds per step (MAL: tokens per
step). A pair's overlap is ``(g_A + g_B - g_AB) / min(g_A, g_B)``: 0 when their gains add up, 1
when the pair is worth no more than its better scope alone. A synthetic workload that credits
a combined strategy must reproduce these overlaps (issue 51 part 4). Each combination runs twice:
the draft with the highest expected accepted length wins, and (``weighted``) each scope's
expectation is weighed by how its drafts fared for the prompt (``SpecOptions.scope_weights``).

    OMP_NUM_THREADS=1 python scripts/bench_scopes.py --json
    OMP_NUM_THREADS=1 python scripts/bench_scopes.py --json --trace data/traces/smollm2_arith_e2.parquet --k 8
    OMP_NUM_THREADS=1 python scripts/bench_scopes.py --json --synth measured --synth published   # the simulator's workloads
    OMP_NUM_THREADS=1 python scripts/bench_scopes.py --json --synth published --synth-knobs '{"shared_path": 1}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRACES = ("data/traces/smollm2_arith_t07_e2.parquet", "data/traces/smollm2_arith_e2.parquet")
SCOPES = ("request", "group", "history", "global")


def synthetic(level: str, prompts: int, samples: int, mean_len: int, knobs: dict | None = None):
    """The simulator's synthetic workload at similarity ``level`` (``verl-ext sim --similarity``),
    two epochs of ``prompts`` x ``samples`` responses of mean ``mean_len`` tokens; ``knobs``
    (``SynthConfig`` content knobs) replace the level's."""
    from verl_ext.sim.runner import SimConfig
    from verl_ext.sim.workload import load_workload

    shape = {"prompts": prompts, "samples": samples, "mean_len": mean_len, "max_len": 4 * mean_len}
    return load_workload(SimConfig(synth={**shape, **(knobs or {})}, similarity=level))


def measure(path, k: int) -> dict:
    """``path``: a trace file, or a ``Trace`` (a synthetic workload)."""
    from verl_ext.spec import SpecOptions
    from verl_ext.trace.synth.similarity import scope_replay
    from verl_ext.trace.format import read_trace

    trace = read_trace(path) if isinstance(path, str) else path
    sets = [(s,) for s in SCOPES] + list(itertools.combinations(SCOPES, 2)) + [SCOPES]
    rows = {}

    def row(spec):
        r = scope_replay(trace, spec)
        return r, {"mal": round(r["tokens_per_step"], 4), "acceptance": round(r["acceptance"], 4),
                   "steps": r["steps"], "draft_tokens": r["draft_tokens"]}

    for combo in sets:
        name = "+".join(combo)
        r, rows[name] = row(SpecOptions(scopes=name, k=k))
        if len(combo) > 1:  # the same scopes, each weighed by how its drafts fared (scope_weights)
            _, rows[name + " weighted"] = row(SpecOptions(scopes=name, k=k, scope_weights=True))
    gain = {name: row["mal"] - 1.0 for name, row in rows.items()}
    overlap = {}
    for a, b in itertools.combinations(SCOPES, 2):
        lo = min(gain[a], gain[b])
        overlap[f"{a}+{b}"] = round((gain[a] + gain[b] - gain[f"{a}+{b}"]) / lo, 3) if lo > 0 else None
    best = max((s for s in SCOPES), key=lambda s: rows[s]["mal"])
    meta = trace.meta if hasattr(trace, "meta") else {}
    return {"trace": path if isinstance(path, str) else "synthetic", "temperature": (meta or {}).get("temperature"), "responses": r["responses"],
            "k": k, "rows": rows, "pair_overlap": overlap, "best_single": best, "all": rows["+".join(SCOPES)]["mal"],
            "all_weighted": rows["+".join(SCOPES) + " weighted"]["mal"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--trace", action="append", help=f"trace(s) to replay (default: {', '.join(TRACES)})")
    p.add_argument("--k", type=int, default=8, help="draft tokens per step (default 8)")
    p.add_argument("--synth", action="append", metavar="LEVEL",
                   help="also the simulator's synthetic workload at this similarity level (measured, published, ...)")
    p.add_argument("--synth-shape", default="64,8,512", metavar="P,S,L",
                   help="its prompts, samples and mean length (default 64,8,512)")
    p.add_argument("--synth-knobs", default=None, metavar="JSON",
                   help='content knobs that replace the level\'s, e.g. \'{"shared_path": 1, "self_from_history": 1}\'')
    args = p.parse_args(argv)
    from verl_ext.trace.synth import knobs_from_json

    try:
        knobs = knobs_from_json(args.synth_knobs) if args.synth_knobs else {}
    except ValueError as e:
        p.error(f"--synth-knobs: {e}")
    t0 = time.monotonic()
    out = {"bench": "scopes", "traces": [measure(str(REPO / t) if not Path(t).is_absolute() else t, args.k)
                                         for t in (args.trace or ([] if args.synth else TRACES))]}
    prompts, samples, mean_len = (int(x) for x in args.synth_shape.split(","))
    for level in args.synth or ():
        row = measure(synthetic(level, prompts, samples, mean_len, knobs), args.k)
        row.update(trace=f"synthetic {level}, {prompts} x {samples}, mean {mean_len}" + (f", {knobs}" if knobs else ""))
        out["traces"].append(row)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if not args.json:
        for t in out["traces"]:
            print(f"{t['trace']} (T={t['temperature']}, {t['responses']} responses, k={t['k']})", file=sys.stderr)
            for name, row in t["rows"].items():
                print(f"  {name:32s} MAL {row['mal']:.3f}  acceptance {row['acceptance']:.3f}", file=sys.stderr)
            print(f"  pair overlap: {t['pair_overlap']}", file=sys.stderr)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
