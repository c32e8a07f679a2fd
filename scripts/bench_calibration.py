"""Where each similarity level of the synthetic workloads lands against its per-scope targets.

For every level (``verl_ext.trace.synth.calibration.SCOPE_TARGETS``): its knobs, each target with
the band it must fall in, the value achieved, ``ok`` and the paper (or trace) the band comes from;
the references listed apart (``SCOPE_REFERENCES``: a paper's figure that needs what verl_ext's
drafting lacks, with the value the level gives, unchecked); and the statistics recorded beside them (speculation rate, HistoSpec's speed-up, reuse fraction).
Measured by ``verl_ext.sim.calibration.check_level`` on ``CALIBRATION_CONFIG`` (24 prompts x 8
samples x 2 epochs, mean 2,048 tokens), the mean of one workload per seed; deterministic.
``--fit LEVEL`` searches that level's knobs instead (minutes) and prints what it found.

    OMP_NUM_THREADS=1 python scripts/bench_calibration.py --json
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    ap.add_argument("--levels", default="published,measured", help="comma-separated similarity levels")
    ap.add_argument("--seeds", default="0,1", help="comma-separated workload seeds (their mean is reported)")
    ap.add_argument("--fit", default=None, metavar="LEVEL", help="search LEVEL's knobs instead of checking")
    ap.add_argument("--rounds", type=int, default=6, help="with --fit: search rounds")
    ap.add_argument("--knobs", default=None, metavar="JSON",
                    help='measure these knobs instead of the levels\' (e.g. \'{"group_similarity": 0.7}\'; unset knobs are 0)')
    args = ap.parse_args()

    from verl_ext.sim.calibration import check_level, fit_level, measure_knobs, score
    from verl_ext.trace.synth.calibration import KNOBS, SCOPE_TARGETS, knobs_from_json

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.fit:
        found = fit_level(args.fit, rounds=args.rounds, seeds=seeds, log=lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps(found, indent=1))
        return 0
    if args.knobs:
        knobs = {k: 0.0 for k in KNOBS}
        try:
            knobs.update(knobs_from_json(args.knobs))
        except ValueError as e:
            ap.error(f"--knobs: {e}")
        measured = measure_knobs(knobs, seeds=seeds)
        out = {"seeds": seeds, "knobs": knobs, "measured": {k: round(v, 4) for k, v in measured.items()},
               "targets": {lv: score(lv, measured) for lv in SCOPE_TARGETS}}
        print(json.dumps(out, indent=1))
        return 0
    levels = [s.strip() for s in args.levels.split(",") if s.strip()]
    unknown = [lv for lv in levels if lv not in SCOPE_TARGETS]
    if unknown:
        ap.error(f"unknown similarity level(s) {unknown}; available: {sorted(SCOPE_TARGETS)}")
    out = {"seeds": seeds, "levels": {lv: check_level(lv, seeds=seeds) for lv in levels}}
    out["ok"] = all(r["ok"] for r in out["levels"].values())
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for lv, r in out["levels"].items():
        print(f"{lv}: {r['label']}")
        for t in r["targets"]:
            lo, hi = t["band"]
            print(f"  {t['scope']:>9} {t['name']:<24} {t['achieved']:>8.3f}  in [{lo}, {hi}]  {'ok' if t['ok'] else 'MISS'}")
        for ref in r["references"]:
            print(f"  {ref['scope']:>9} {ref['name']:<24} {ref['achieved']:>8.3f}  reference {ref['reference']} "
                  f"(not checked: needs {ref['needs']})")
        print("  recorded: " + ", ".join(f"{k} {v:.3f}" for k, v in r["recorded"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
