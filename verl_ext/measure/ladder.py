"""``verl-ext fit ladder``: SpecActor's draft ladder (section 4.2) built against a
verifier cost model (:class:`verl_ext.spec.ladder.DraftLadder`), with suffix methods' acceptance
measured by replaying the drafter over a trace (``@trace``) and their proposal time measured
on this CPU. ``specactor[ladder=...]`` reads the written JSON."""

from __future__ import annotations

import dataclasses

import numpy as np

from verl_ext.measure import json_out
from verl_ext.perf.cost import load_cost_model
from verl_ext.spec.ladder import DraftLadder, LadderError, measure_suffix_draft, parse_method
from verl_ext.spec.options import SpecOptions
from verl_ext.spec.replay import trace_acceptance
from verl_ext.trace.format import read_trace


def resolve_methods(args, default=("suffix=suffix:request+group@trace", "ngram=suffix:request@trace")) -> list:
    """``--method`` values (or ``default``) as ``DraftMethod``s with their acceptance, measured on
    ``--ladder-trace`` where the rate is ``@trace``, and suffix methods' measured proposal time."""
    parsed = [parse_method(m) for m in (args.method or default)]
    draft_s = None
    rates = {}
    trace = None
    for m, measured in parsed:
        if measured and not args.ladder_trace:
            raise LadderError(f"method {m.name}: '@trace' needs a trace (--trace TRACE[@EPOCH])")
        if m.kind == "suffix" and draft_s is None:
            draft_s = measure_suffix_draft(k=args.ladder_k)
        if measured:
            if trace is None:
                path, _, epoch = args.ladder_trace.partition("@")
                trace = read_trace(path)
                e = int(epoch) if epoch else trace.epochs()[0]
                rows = np.flatnonzero(trace.epoch == e)
            if m.kind != "suffix":
                raise LadderError(f"method {m.name}: only suffix methods can be measured on a trace (model drafters need their model)")
            rates[m.name] = trace_acceptance(trace, rows, SpecOptions(scopes=m.scopes, k=args.ladder_k))["acceptance"]
    return [dataclasses.replace(m, acceptance=rates.get(m.name, m.acceptance),
                                draft_s=draft_s if m.kind == "suffix" else (0.0, 0.0)) for m, _ in parsed]


def print_ladder(lad: DraftLadder, out) -> None:
    print(f"draft ladder for {lad.target} ({lad.hardware}, {lad.model}) -> {out}")
    print("method    acc   " + "  ".join(f"b={b:<4d}" for b in lad.batches))
    for n, m in lad.methods.items():
        print(f"{n:9s} {m.acceptance:.2f}  " + "  ".join(f"{lad.lookup(n, m.acceptance, b):5.2f}x" for b in lad.batches))
    if lad.idle:
        print("drafting engine, nothing drafted: " + "  ".join(f"{1 + o:5.3f}x time" for o in lad.idle))
    for b in lad.batches:
        print(f"initial selection at batch {b}: {lad.select(b) or 'plain decoding'}; a drafter for engines starting "
              f"at this batch saves {100 * lad.drafter_gain(b):+.1f}% of decode time")


def run(args) -> int:
    """``verl-ext fit ladder PRESET_OR_JSON --method ... --out LADDER.json``."""
    out = json_out(args.out)
    verifier = load_cost_model(args.ladder)
    methods = resolve_methods(args)
    lad = DraftLadder.build(verifier, methods, verify_gpus=args.verify_gpus, max_window=args.ladder_k)
    lad.save(out)
    print_ladder(lad, out)
    return 0
