"""``verl-ext fit acceptance``: RLHFSpec's acceptance map ``F`` from a drafter replayed over a
trace (:func:`verl_ext.spec.replay.fit_from_trace`); ``rollout=rlhfspec`` reads the written
JSON through ``options.acceptance_profile``."""

from __future__ import annotations

import json

import numpy as np

from verl_ext.measure import json_out
from verl_ext.spec.options import SpecOptions
from verl_ext.spec.replay import fit_from_trace
from verl_ext.trace.format import read_trace


def run(args) -> int:
    """``verl-ext fit acceptance TRACE[@EPOCH] --out F.json``."""
    out = json_out(args.out)
    path, _, epoch = args.acceptance.partition("@")
    trace = read_trace(path)
    epochs = trace.epochs()
    e = int(epoch) if epoch else epochs[-1]
    if e not in epochs:
        raise ValueError(f"{args.acceptance}: epoch {e} is not in the trace (epochs: {epochs})")
    rows = np.flatnonzero(trace.epoch == e)
    spec = SpecOptions(scopes=args.acceptance_scopes, k=args.acceptance_k, min_prob=0.0)
    model, info = fit_from_trace(trace, rows, spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"acceptance": model.to_dict(), "fit": {**info, "trace": path, "epoch": e}}, indent=1))
    print(f"F fitted on {info['nodes']} draft nodes ({info['accepted']} accepted): "
          f"{' '.join(f'{x:.2f}' for x in model.table()[0][::4])} at scores 0, 0.2, ..., 1 (depth 0) -> {out}")
    return 0
