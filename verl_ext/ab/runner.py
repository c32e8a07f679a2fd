"""``verl-ext ab``: the same prompts and seeds through each strategy, on fresh engines, side by side.

For each strategy: start fresh instances, warm them up, run every (prompt, sample) request
through the strategy, score the responses, and collect ``RequestRecord`` timings plus a
telemetry timeline. Outputs go to a staging directory that replaces the files in ``--out`` only
when the whole run succeeded, so a failed run leaves no half-written results.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import platform
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from verl_ext.ab.metrics import SCHEMA, rollout_metrics
from verl_ext.engine.instance import GenRequest, Instance, SamplingSpec
from verl_ext.pipe.defer import require_carrier
from verl_ext.pipe.lifecycle import UNSET, Lifecycle
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy, make_strategy
from verl_ext.spec._suffix import SCOPE_HISTORY
from verl_ext.workload.arith import Problem, encode_prompts, make_problems, make_scorer
from verl_ext.workload.arith import DEFAULT_DIFFICULTY, check_difficulty

TELEMETRY_PERIOD_S = 0.05


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
    #: cost model of the engines (preset or `verl-ext profile` JSON) for strategies' adaptive draft
    #: thresholds (seer); None: `cpu-smollm2` (AVX2-only x86: `cpu-smollm2-avx2`) for the default
    #: model on vllm-cpu, else none
    preset: Optional[str] = None
    #: rounds over the arms, each arm on fresh engines in every round, the order rotated by one
    #: arm per round (so no arm always runs first); an arm's metrics are its median round's
    repeats: int = 1
    #: level of the arithmetic workload (``verl_ext.workload.arith.LEVELS``)
    difficulty: int = DEFAULT_DIFFICULTY
    #: file for the default local engines' logs and output (``verl_ext.engine.engine_log``);
    #: None: the terminal
    engine_log: Optional[str] = None

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


def validate_strategies(strategies: Sequence[str]) -> None:
    """The ``--strategies`` list of an A/B run (real or simulated): non-empty, no repeats."""
    if not strategies:
        raise ValueError("--strategies is empty")
    if len(set(strategies)) != len(strategies):
        raise ValueError(f"--strategies lists a strategy twice: {list(strategies)}")


SPEC_SUFFIX = "+spec"
#: cost model of the default model on vllm-cpu (draft thresholds and selection of real-engine
#: arms), by the dtype the local engines run (``vllm_local.cpu_default_dtype``): bf16 on
#: AVX-512 machines, float32 on AVX2-only x86 machines
CPU_DEFAULT_PRESET = "cpu-smollm2"
CPU_FLOAT32_PRESET = "cpu-smollm2-avx2"


def cpu_default_preset() -> str:
    """The shipped cost model of the default model's local vllm-cpu engines on this machine."""
    from verl_ext.engine.vllm_local import cpu_default_dtype

    return CPU_FLOAT32_PRESET if cpu_default_dtype() == "float32" else CPU_DEFAULT_PRESET


def split_arms(text: str) -> list[str]:
    """Split a ``--strategies`` value on the commas outside ``[...]`` option lists."""
    arms, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in --strategies {text!r}")
        if ch == "," and depth == 0:
            arms.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in --strategies {text!r}")
    arms.append("".join(cur).strip())
    return [a for a in arms if a]


def _option_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_options_label(name: str) -> tuple[str, dict, str]:
    """``"seer[context=false,spec_k=4]+spec"`` -> (``"seer"``, options, ``"+spec"``)."""
    if "[" not in name:
        return name, {}, ""
    base, _, rest = name.partition("[")
    body, sep, tail = rest.partition("]")
    if not sep:
        raise ValueError(f"bad arm '{name}': options go in [key=value,...]")
    options = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad arm '{name}': option '{item}' is not key=value")
        options[key.strip()] = _option_value(value)
    return base.strip(), options, tail


def parse_arm(name: str, spec_k: int = 8, allow_history: bool = False):
    """``"baseline"`` -> (``"baseline"``, None); ``"baseline+spec"`` -> request-scope drafting;
    ``"baseline+spec:group"`` / ``":request+group"`` choose the scopes. Raises ``ValueError``.
    The history scope needs an earlier epoch: only simulated runs over a trace have one."""
    base, sep, rest = name.partition(SPEC_SUFFIX)
    if not sep:
        return name, None
    if rest and not rest.startswith(":"):
        raise ValueError(f"bad arm '{name}': write <strategy>+spec or <strategy>+spec:<scopes>")
    from verl_ext.spec.options import SpecOptions, scope_mask
    from verl_ext.spec import SCOPE_HISTORY

    scopes = rest[1:] or "request"
    if scope_mask(scopes) & SCOPE_HISTORY and not allow_history:
        raise ValueError(
            f"arm '{name}': the history scope drafts from an earlier epoch's responses; run 2+ epochs "
            "(`verl-ext ab --epochs 2`, or `--sim` over a trace with 2+ epochs), or use request and/or group"
        )
    return base, SpecOptions(scopes=scopes, k=spec_k)


#: what a caller of ``make_arm`` is by default, for the error refusing inter-step migration
SINGLE_ROLLOUT = "a single rollout (`verl-ext ab` without `--pipeline`, `verl-ext record`)"


def make_arm(label: str, spec_k: int = 8, allow_history: bool = False, cost=None,
             carrier: Optional[str] = SINGLE_ROLLOUT):
    """(strategy, SpecOptions or None) for one ``--strategies`` entry: ``name[key=value,...]``
    sets strategy options, ``+spec[:scopes]`` turns on drafting explicitly; otherwise the
    strategy's own ``engine_spec`` (e.g. ``seer``'s grouped drafting) decides. ``carrier``: None
    when the caller carries deferred samples to the next step (off-policy pipelines), else what
    the caller is, for the error refusing a strategy that defers (``verl_ext.pipe.defer``)."""
    base, options, tail = parse_options_label(label)
    name, spec = parse_arm(base + tail, spec_k, allow_history)
    strategy = make_strategy(name, options)  # unknown name or option -> clear error
    require_carrier(strategy, carrier is None, carrier)
    if spec is None:
        spec = strategy.engine_spec(cost)
    return strategy, spec


@dataclass
class ArmResult:
    """One strategy's rollout over one set of instances."""

    completions: list
    rewards: list[float]
    metrics: dict
    pool: InstancePool
    timeline: dict  # instance -> [(t, running)]


@dataclass
class StrategyRun:
    name: str
    metrics: dict
    records: list
    timeline: dict  # instance -> [(t, running)]
    responses: list[dict]
    token_ids: list = field(default_factory=list, repr=False)  # per response (last epoch), not written


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


async def _sample_telemetry(instances: Sequence[Instance], pool: InstancePool, timeline: dict, stop: asyncio.Event):
    while True:
        t = pool.now()
        for inst in instances:
            timeline[inst.name].append((t, inst.telemetry().running))
        if stop.is_set():  # the last sample is taken after the rollout ended
            return
        try:
            await asyncio.wait_for(stop.wait(), TELEMETRY_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def run_strategy(
    strategy: Strategy,
    instances: Sequence[Instance],
    requests: Sequence[GenRequest],
    score: Callable[[GenRequest, list[int]], float],
    seed: int = 0,
    on_finish: Optional[Callable[[], None]] = None,
    clock: Optional[Callable[[], float]] = None,
    sample_telemetry: bool = True,
    lifecycle: Optional[Lifecycle] = None,
) -> ArmResult:
    """Run ``requests`` through ``strategy`` on ``instances`` and measure it. ``clock``: the
    pool's clock (the simulator passes its virtual one); ``sample_telemetry=False`` skips the
    running-requests sampler (simulated instances log every change themselves); ``lifecycle``:
    the driver's ``Lifecycle`` of ``strategy`` (its history and step; default: a bare one)."""
    life = lifecycle if lifecycle is not None else Lifecycle(strategy)
    pool = InstancePool(instances, seed=seed, **({"clock": clock} if clock is not None else {}))
    if on_finish is not None:
        pool.on_finish = lambda record: on_finish()
    timeline = {inst.name: [] for inst in instances}
    stop = asyncio.Event()
    await strategy.prepare(pool)  # long-lived helpers start outside the timed rollout
    before = [inst.telemetry() for inst in instances]
    await life.mark(instances)
    pool.reset_clock()
    sampler = asyncio.ensure_future(_sample_telemetry(instances, pool, timeline, stop)) if sample_telemetry else None
    try:
        completions = await strategy.rollout(requests, pool)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        await strategy.close()
    rewards = [score(req, c.token_ids) for req, c in zip(requests, completions)]
    metrics = rollout_metrics(pool.records, rewards, delivered_tokens=sum(len(c.token_ids) for c in completions))
    after = [inst.telemetry() for inst in instances]
    if metrics["tokens_per_step"] is None:
        # engines that count steps per instance rather than per request (vLLM's stat logger)
        tokens = sum(a.generated_tokens - b.generated_tokens for a, b in zip(after, before))
        steps = sum(a.request_steps - b.request_steps for a, b in zip(after, before))
        metrics["tokens_per_step"] = tokens / steps if steps > 0 else None
    drafted = sum(a.draft_tokens - b.draft_tokens for a, b in zip(after, before))
    accepted = sum(a.accepted_tokens - b.accepted_tokens for a, b in zip(after, before))
    metrics["draft_tokens"] = drafted
    metrics["accepted_tokens"] = accepted
    metrics["draft_acceptance"] = accepted / drafted if drafted else None
    metrics.update({f"strategy/{k}": v for k, v in strategy.metrics().items()})
    metrics["mechanisms"] = await life.mechanisms(instances)
    return ArmResult(completions, rewards, metrics, pool, timeline)


def _check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise ValueError(f"output directory '{out}' is not writable ({exc.strerror or exc})") from None


def prepare(cfg: ABConfig):
    """Validate everything that can fail before any engine starts; return (model_dir, out, arms),
    an arm being (label, strategy, SpecOptions or None)."""
    cfg.validate()
    cost = _engine_cost(cfg)
    arms = []
    for label in cfg.strategies:
        strategy, spec = make_arm(label, cfg.spec_k, allow_history=cfg.epochs > 1, cost=cost)
        if spec is not None and spec.mask & SCOPE_HISTORY and cfg.epochs < 2:
            raise ValueError(f"arm '{label}': the history scope needs an earlier epoch; run `verl-ext ab --epochs 2`")
        arms.append((label, strategy, spec))
    out = Path(cfg.out)
    _check_out_dir(out)
    from verl_ext.model import resolve_model

    return resolve_model(cfg.model), out, arms


def _engine_cost(cfg: ABConfig):
    """The engines' cost model for adaptive draft thresholds (``ABConfig.preset``)."""
    from verl_ext.sim.cost import load_cost_model

    name = cfg.preset
    if name is None and cfg.model is None:
        try:
            from verl_ext.engine.vllm_local import is_cpu_build

            name = cpu_default_preset() if is_cpu_build() else None
        except ImportError:  # no vLLM here: the engines come from elsewhere
            name = None
    if name is None:
        return None
    try:
        return load_cost_model(name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--preset: {exc}") from None


def _drafting_off(cfg: ABConfig, label: str, spec, engine_factory) -> Optional[str]:
    """Why an arm whose strategy asked for drafting runs without it, or None. Engines that draft
    greedy requests only (vllm-cpu) cannot use drafts at temperature > 0: the drafter would only
    add its per-step cost. An explicit ``+spec`` arm keeps it (it measures that cost)."""
    if spec is None or SPEC_SUFFIX in label or cfg.temperature == 0:
        return None
    sampled = getattr(engine_factory, "drafts_sampled", None)
    if sampled is None or sampled():
        return None
    return "the engines draft greedy requests only (vllm-cpu) and temperature > 0"


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
        from verl_ext.engine.vllm_local import VLLMInstanceFactory

        k = max((spec.k for _, _, spec in arms if spec is not None), default=0)
        engine_factory = VLLMInstanceFactory(str(model_dir), seed=cfg.seed, max_model_len=_max_len(prompt_ids, cfg, k),
                                             extra_engine_args=engine_args, engine_log=cfg.engine_log)

    cost = _engine_cost(cfg) if cfg.repeats > 1 else None
    rounds: dict[str, list[StrategyRun]] = {label: [] for label, _, _ in arms}
    for r in range(cfg.repeats):
        for label, strategy, spec in round_order(arms, r):
            if r:  # every round starts the strategy afresh (its state is per rollout and per run)
                strategy, _ = make_arm(label, cfg.spec_k, allow_history=cfg.epochs > 1, cost=cost)
            off = _drafting_off(cfg, label, spec, engine_factory)
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
    _write_outputs(out, summary, runs)
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


def format_repeats(summary: dict) -> str:
    """Per arm: wall time in every round, its median, and the median ratio to the first arm's
    wall time in the same round (``--repeats``); empty for single rounds."""
    arms = summary["strategies"]
    first = next(iter(arms))
    lines = []
    for name, m in arms.items():
        rep = m.get("repeats")
        if not rep:
            return ""
        walls = " ".join(f"{w:.2f}" for w in rep["wall_s"])
        ratios = " ".join(f"{x:.3f}" for x in rep[f"wall_vs_{first}"])
        lines.append(f"{name}: wall s per round {walls} (median {rep['wall_s_median']:.2f}); "
                     f"vs {first} per round {ratios} (median {rep[f'wall_vs_{first}_median']:.3f})")
    return "\n".join(lines)


def _max_len(prompt_ids: Sequence[list[int]], cfg: ABConfig, spec_k: int = 0) -> int:
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
        from verl_ext.pipe.rhyme import LocalHistory

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
    return StrategyRun(
        name=label,
        metrics=metrics if spec is None else {**metrics, "spec": spec.to_dict()},
        records=[asdict(r) for r in arm.pool.records],
        timeline=arm.timeline,
        responses=responses,
        token_ids=[list(c.token_ids) for c in arm.completions],
    )


def same_tokens(runs: Sequence[StrategyRun]) -> None:
    """Add ``same_tokens_as_first`` to every later arm's metrics: how many of its responses are
    token-identical to the first arm's response to the same request (same prompts and seeds in
    every arm). At temperature 0 a lossless strategy must match all of them; sampled requests
    match where the engine's seeded sampling does not depend on what else runs or is drafted."""
    if not runs:
        return
    first = runs[0]
    for run in runs[1:]:
        same = sum(a == b for a, b in zip(first.token_ids, run.token_ids))
        run.metrics["same_tokens_as_first"] = {"first": first.name, "same": same, "of": len(first.token_ids)}


def not_identical(summary: dict) -> list[str]:
    """``arm: same/of`` for every arm whose responses are not all token-identical to the first
    arm's (``same_tokens``); empty when all are."""
    return [f"{name}: {st['same']}/{st['of']}" for name, m in summary["strategies"].items()
            if (st := m.get("same_tokens_as_first")) and st["same"] != st["of"]]


def format_same_tokens(summary: dict) -> str:
    """One line per arm compared with the first (``same_tokens``); empty if none was."""
    lines = []
    for name, m in summary["strategies"].items():
        st = m.get("same_tokens_as_first")
        if st:
            lines.append(f"{name}: {st['same']}/{st['of']} responses token-identical to {st['first']}'s")
    return "\n".join(lines)


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
    try:
        return await run_strategy(life.strategy, instances, requests, score, seed=cfg.seed,
                                  on_finish=(bar.update if bar else None), lifecycle=life)
    finally:
        if bar is not None:
            bar.close()


async def _load_histories(instances, store, requests, step: int) -> None:
    """Give every drafting engine the earlier epochs' responses of this epoch's prompts (what the
    history workers serve inside veRL), before the timed rollout."""
    from verl_ext.pipe.rhyme import LocalHistory, set_histories_items

    items = set_histories_items(await LocalHistory(store).serve(sorted({r.group_id for r in requests}), step))
    if items:  # replaces each prompt's tree: an epoch's history holds every earlier epoch's responses
        await asyncio.gather(*(inst.drafter_call("set_histories", items) for inst in instances
                               if hasattr(inst, "drafter_call")))


def write_staged(out: Path, summary: dict, runs, extra: Callable[[Path], None]) -> None:
    """Write ``summary.json``, ``requests.jsonl`` (each run's ``records``) and whatever ``extra``
    writes into a staging directory, then move it all into ``out``: a run that fails while
    writing leaves the previous results in place, not half-written ones."""
    staging = Path(tempfile.mkdtemp(prefix=".ab-staging-", dir=out))
    try:
        (staging / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with open(staging / "requests.jsonl", "w") as f:
            for run in runs:
                for rec in run.records:
                    f.write(json.dumps({"strategy": run.name, **rec}) + "\n")
        extra(staging)
        for item in staging.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_outputs(out: Path, summary: dict, runs: Sequence[StrategyRun]) -> None:
    from verl_ext.ab.plots import plot_completion_cdf, plot_running
    from verl_ext.pipe.pool import RequestRecord

    def extra(staging: Path) -> None:
        with open(staging / "responses.jsonl", "w") as f:
            for run in runs:
                for resp in run.responses:
                    f.write(json.dumps({"strategy": run.name, **resp}) + "\n")
        plot_completion_cdf({r.name: [RequestRecord(**x) for x in r.records] for r in runs}, staging / "completion_cdf.png")
        plot_running({r.name: r.timeline for r in runs}, staging / "running_requests.png")

    write_staged(out, summary, runs, extra)


def format_table(summary: dict) -> str:
    cols = [
        ("strategy", None, "{}"),
        ("wall s", "wall_s", "{:.2f}"),
        ("tok/s", "throughput_tok_s", "{:.1f}"),
        ("p50 s", "latency_p50_s", "{:.2f}"),
        ("p90 s", "latency_p90_s", "{:.2f}"),
        ("max s", "latency_max_s", "{:.2f}"),
        ("tail s", "tail_s", "{:.2f}"),
        ("tok/step", "tokens_per_step", "{:.2f}"),
        ("accept", "draft_acceptance", "{:.2f}"),
        ("reward", "mean_reward", "{:.3f}"),
        ("requests", "requests", "{}"),
        ("out tok", "output_tokens", "{}"),
    ]
    return render_table(summary, cols)


def render_table(summary: dict, cols) -> str:
    """A plain-text table of ``summary["strategies"]``: ``cols`` is [(header, metric key or None
    for the arm's name, format)]; missing metrics print as ``-``."""
    rows = [[c[0] for c in cols]]
    for name, m in summary["strategies"].items():
        row = []
        for _, key, fmt in cols:
            value = name if key is None else m.get(key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
