"""SpecActor's decoupled plan (Algorithm 1) against coupled speculation, from cost models.

For a verifier preset (default h100-32b on TP4) and a draft-model preset (default h100-0.5b on one
GPU), prints for per-worker batches and acceptance rates: Algorithm 1's plan (drafter GPUs,
verifier GPUs, window) and its speedup over plain decoding on all GPUs, next to the best coupled
speculation's speedup at the same per-worker batch. Writes the table as JSON.

    python scripts/bench_specactor.py [--verifier h100-32b] [--verify-gpus 4] [--drafter h100-0.5b]
        [--gpus 256] [--out runs/bench_specactor_plan.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verl_ext.perf.cost import load_cost_model
from verl_ext.spec.ladder import DraftMethod
from verl_ext.spec.tgs import COUPLED, plan_decoupled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="h100-32b")
    ap.add_argument("--verify-gpus", type=int, default=4)
    ap.add_argument("--drafter", default="h100-0.5b")
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--batches", default="16,64,128,256")
    ap.add_argument("--rates", default="0.4,0.6,0.8,0.9")
    ap.add_argument("--out", default="runs/bench_specactor_plan.json")
    a = ap.parse_args()
    v = load_cost_model(a.verifier)
    t = DraftMethod("drafter", "model", 0.5, drafter=a.drafter).times(v, verify_gpus=a.verify_gpus)
    rows = []
    print(f"verifier {v.name} (TP{a.verify_gpus}), drafter {a.drafter}, {a.gpus} GPUs")
    print("batch/worker  p     plan (g_d, g_v, w)  decoupled x  coupled w  coupled x")
    for b in map(int, a.batches.split(",")):
        for p in map(float, a.rates.split(",")):
            pl = plan_decoupled([t], b * a.gpus // a.verify_gpus, a.gpus, p)
            wc, tc = t.best_window(p, b, COUPLED)
            row = {"batch": b, "p": p, "g_d": pl.g_d, "g_v": pl.g_v, "w": pl.w, "decoupled_speedup": pl.speedup,
                   "coupled_w": wc, "coupled_speedup": tc / t.tgs_plain(b)}
            rows.append(row)
            print(f"{b:<12d}  {p:.2f}  ({pl.g_d}, {pl.g_v}, {pl.w:<2d})          {pl.speedup:5.2f}x       {wc:<2d}        "
                  f"{row['coupled_speedup']:5.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"verifier": v.name, "drafter": a.drafter, "gpus": a.gpus, "rows": rows}, indent=1))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
