"""``verl-ext fit steplog``: the draft costs of a base cost model, fitted to drafting engines'
step logs (``VERL_EXT_STEPLOG``; the fit is :mod:`verl_ext.perf.steplog_fit`)."""

from __future__ import annotations

import dataclasses
import glob
import json
import time
from pathlib import Path

from verl_ext.measure import json_out
from verl_ext.perf.cost import load_cost_model
from verl_ext.perf.steplog_fit import WINDOW_STEPS, fit_draft_costs, steplog_windows


def _base_fit(base: str):
    """The ``fit`` section of a base cost model given as a JSON file (None for a preset name)."""
    path = Path(base)
    if not path.is_file():
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {"fields": {k: v for k, v in raw.items() if k != "fit"}, "fit": raw.get("fit")}


def run(args) -> int:
    """``verl-ext fit steplog GLOB ... --base BASE --out P.json``."""
    out = json_out(args.out)
    paths = []
    for pattern in args.from_steplog:
        found = sorted(glob.glob(pattern))
        if not found:
            raise ValueError(f"{pattern}: no such file")
        paths.extend(found)
    base = load_cost_model(args.base)
    windows = steplog_windows(paths)
    cost, report = fit_draft_costs(windows, base)
    cost = dataclasses.replace(
        cost,
        name=args.name or out.stem,
        sources=(*base.sources,
                 f"draft_token_s, draft_kv_token_s: verl-ext fit steplog {' '.join(args.from_steplog)} "
                 f"--base {args.base}, {time.strftime('%Y-%m-%d')}"),
        assumptions=(*base.assumptions,
                     "draft costs fitted on drafting engines' decode-only steps (VERL_EXT_STEPLOG), relative to the "
                     "base terms; a draft's context is its step's mean context"),
    )
    doc = cost.to_dict()
    # the windows fitted, and the base's own fit section when it is a file: the result can be
    # re-derived from what it records (tests/test_cost_model.py checks the shipped CPU presets)
    doc["fit"] = {"from_steplogs": args.from_steplog, "files": len(paths), **report, "windows": windows,
                  "base": _base_fit(args.base)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"fit ({report['windows']} windows of {WINDOW_STEPS} decode-only steps, {report['draft_windows']} with drafts, "
          f"{report['draft_tokens_per_step']:.1f} drafts/step): speed factor {report['speed_factor']:.3f}; "
          f"draft_token_s {cost.draft_token_s * 1e6:.1f} us, draft_kv_token_s {cost.draft_kv_token_s * 1e9:.2f} ns")
    print(f"mean |rel err|: base {report['base_mean_abs_rel_err']:.1%} -> fitted {report['fitted_mean_abs_rel_err']:.1%}")
    for b in report["bins"]:
        print(f"  {b['drafts_per_step']:>6} drafts/step ({b['windows']} windows): mean rel err base "
              f"{b['base_mean_rel_err']:+.1%}, fitted {b['fitted_mean_rel_err']:+.1%}")
    print(f"wrote {out}")
    return 0
