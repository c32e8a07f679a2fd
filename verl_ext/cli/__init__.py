"""The ``verl-ext`` command: one sub-command per job, one error policy.

    verl-ext ab --strategies baseline,seer,rhyme [--prompts 16 --samples 4 --max-tokens 192 ...]
                                   strategies side by side on real local engines
    verl-ext sim --strategies baseline,seer [--trace T.parquet | --mean-len 4096] [--preset h100-7b]
                                   the same comparison on simulated instances, at cluster scale
    verl-ext fit KIND ...          cost models, acceptance maps and ladders (grid, trace, steplog,
                                   acceptance, ladder, engine-ladder, thresholds)
    verl-ext trace record --out T.parquet   record a rollout trace on real engines
    verl-ext strategies            list the registered strategies
    verl-ext model                 convert the default model if needed and print its directory
    verl-ext doctor [--engine]     what verl_ext sees here: CPU ISA, memory, native extension,
                                   hooks, and (--engine) what a started engine runs

Old spellings (``ab --sim``, ``profile``) still work and print a deprecation note. Bad input
(unknown strategy, invalid model path, n < 1, ...) prints one line and exits 2; an engine that
fails mid-run exits 1 with nothing written to ``--out``; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional


def guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command under the CLI's error policy (see the module docstring)."""
    try:
        return run(args)
    except KeyboardInterrupt:
        print("verl-ext: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input: one clear line, non-zero exit
        print(f"verl-ext: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # an engine failed mid-run; nothing was written to --out
        print(f"verl-ext: engine failure: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _strategies(args) -> int:
    from verl_ext.pipe.strategy import available_strategies

    print("\n".join(available_strategies()))
    return 0


def _model(args) -> int:
    from verl_ext.model import default_model_dir

    print(default_model_dir())
    return 0


def parser(broken: Optional[list] = None) -> argparse.ArgumentParser:
    """The command's parser. Where the commands that need verl_ext's whole stack cannot be
    imported (a broken native extension, a missing dependency), only ``doctor`` is offered and
    the import error goes to ``broken``."""
    from verl_ext.cli import doctor

    p = argparse.ArgumentParser(prog="verl-ext", description="verl_ext: faster veRL rollouts")
    sub = p.add_subparsers(dest="command", required=True)
    doctor.add_commands(sub)  # first, and light: it must run where the rest cannot load
    try:
        from verl_ext.cli import compare, fit, trace
    except ImportError as exc:
        if broken is None:
            raise
        broken.append(exc)
        return p
    compare.add_commands(sub)
    fit.add_commands(sub)
    trace.add_commands(sub)
    sub.add_parser("strategies", help="list the registered strategies").set_defaults(run=_strategies)
    sub.add_parser("model", help="convert the default model if needed and print its directory").set_defaults(run=_model)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    broken: list = []
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(broken)
    if broken and (not argv or argv[0] != "doctor"):
        print(f"verl-ext: cannot load its commands ({type(broken[0]).__name__}: {broken[0]}); "
              "run `verl-ext doctor` to see what is broken", file=sys.stderr)
        return 1
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help exits 0
        return exc.code if isinstance(exc.code, int) else 2
    return guarded(args.run, args)
