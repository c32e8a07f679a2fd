"""``verl-ext trace record``: record a rollout trace on local real engines.

    verl-ext trace record --prompts 64 --samples 8 --epochs 2 --max-tokens 384 \\
        --instances 2 --temperature 1.0 --seed 0 --out data/traces/smollm2_arith_e2.parquet

Runs the arithmetic workload (``verl_ext.workload.arith``) through the ``baseline`` strategy on
``--instances`` local vLLM engines for ``--epochs`` epochs, with the requests ``verl-ext ab``
builds for the same flags: the same prompts every epoch (like RL epochs), the same per-request
seeds (``ab.runner.build_requests``), ``--keyed-sampling`` as there. The default level is the
original one, the committed trace's (``verl-ext ab --difficulty 4``); ``--difficulty`` picks
another. With keyed sampling every strategy's responses are the baseline's, so the trace is the
workload an ``ab`` run of any strategy rolled out (``scripts/bench_sim_vs_real.py`` simulates it).
The engines are started once and warmed up; each epoch is one ``run_strategy`` call.

Recorded per response: epoch (= step), prompt uid (the GRPO group), sample index, prompt and
response ids, the workload's 0/1 reward, finish reason, the serving instance, submit/finish
seconds from the epoch's first submit (the pool's ``RequestRecord``) and per-token arrival
times. The times are taken by a thin ``Instance`` wrapper that passes a recording sink to
``VLLMInstance._run`` (the sink ``VLLMInstance.stream`` uses), so they cost one
``time.monotonic()`` per engine output and nothing else; on engines without that hook the
column is left out (``token_times`` None).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from verl_ext.engine.instance import Completion, GenRequest, Instance, SamplingSpec, Telemetry
from verl_ext.trace.format import Trace, write_trace
from verl_ext.workload.arith import ORIGINAL_DIFFICULTY, check_difficulty


@dataclass
class RecordConfig:
    model: Optional[str] = None
    prompts: int = 64
    samples: int = 8
    epochs: int = 2
    max_tokens: int = 384
    instances: int = 2
    seed: int = 0
    temperature: float = 1.0
    difficulty: int = ORIGINAL_DIFFICULTY  # the arithmetic workload's level (verl_ext.workload.arith.LEVELS)
    keyed_sampling: bool = False  # position-keyed sampling, as `verl-ext ab --keyed-sampling`
    dtype: Optional[str] = None  # the engines' model dtype, as `verl-ext ab --dtype` (None: vLLM's choice)
    engine_log: Optional[str] = None  # the local engines' logs and output to this file, as `verl-ext ab --engine-log`
    strategy: str = "baseline"  # an ab arm: a strategy name, optionally with +spec[:scopes]
    spec_k: int = 8
    out: Optional[str] = "runs/trace.parquet"  # None: do not write, only return the trace

    def validate(self) -> None:
        for name, low in (("prompts", 1), ("samples", 1), ("epochs", 1), ("max_tokens", 1), ("instances", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        check_difficulty(self.difficulty)
        from verl_ext.vllm.local import dtype_engine_args

        dtype_engine_args(self.dtype)  # an unknown dtype -> clear error
        from verl_ext.pipe.arms import make_arm

        make_arm(self.strategy, self.spec_k)  # unknown strategy or option -> clear error
        if self.out is not None:
            out = Path(self.out)
            if out.suffix != ".parquet":
                raise ValueError(f"--out must name a .parquet file, got '{self.out}'")
            if out.is_dir():
                raise ValueError(f"--out '{self.out}' is a directory; name a .parquet file")
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                tempfile.NamedTemporaryFile(dir=out.parent, prefix=".write-test-", delete=True).close()
            except OSError as exc:
                raise ValueError(f"cannot write to '{out.parent}' ({exc.strerror or exc})") from None


class _TimeSink:
    """Receives the token deltas of one request; keeps (time since submit, count) per delta."""

    __slots__ = ("t0", "times", "counts")

    def __init__(self, t0: float):
        self.t0 = t0
        self.times: list[float] = []
        self.counts: list[int] = []

    def put_nowait(self, delta) -> None:
        self.times.append(time.monotonic() - self.t0)
        self.counts.append(len(delta))

    def per_token(self, n_tokens: int) -> Optional[list[float]]:
        if sum(self.counts) != n_tokens:
            return None
        return np.repeat(np.asarray(self.times, dtype=np.float32), self.counts).tolist()


class TimedInstance(Instance):
    """Wraps an instance and records per-token arrival times (``times[request_id]``)."""

    def __init__(self, inner: Instance):
        self.inner = inner
        self.name = inner.name
        self.times: dict[str, Optional[list[float]]] = {}
        self.timed = hasattr(inner, "_run")

    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        if not self.timed:
            return await self.inner.generate(request, on_tokens)
        sink = _TimeSink(time.monotonic())
        completion = await self.inner._run(request, sink, on_tokens)  # VLLMInstance's streaming hook
        self.times[request.request_id] = sink.per_token(len(completion.token_ids))
        return completion

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def __getattr__(self, name):  # optional engine features (e.g. import_drafts) pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def telemetry(self) -> Telemetry:
        return self.inner.telemetry()

    async def start(self) -> None:
        await self.inner.start()

    async def shutdown(self) -> None:
        await self.inner.shutdown()


def record_trace(cfg: RecordConfig, engine_factory=None, progress: bool = True) -> Trace:
    """Record the trace (and write it to ``cfg.out`` unless that is None). ``ValueError`` on bad input."""
    return asyncio.run(arecord_trace(cfg, engine_factory, progress))


async def arecord_trace(cfg: RecordConfig, engine_factory=None, progress: bool = True) -> Trace:
    """``record_trace`` inside a running event loop. ``engine_factory.create(n)`` gives the instances
    (shut down at the end unless the factory has ``owns_instances = False``)."""
    cfg.validate()
    from transformers import AutoTokenizer

    from verl_ext.ab.runner import ABConfig, build_requests, max_model_len
    from verl_ext.model import resolve_model
    from verl_ext.workload.arith import encode_prompts, make_problems, make_scorer

    model_dir = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(cfg.prompts, seed=cfg.seed, difficulty=cfg.difficulty)
    prompt_ids = encode_prompts(tokenizer, problems)
    stop_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    score = make_scorer(tokenizer, problems)
    ab_cfg = ABConfig(prompts=cfg.prompts, samples=cfg.samples, max_tokens=cfg.max_tokens, instances=cfg.instances,
                      seed=cfg.seed, temperature=cfg.temperature, epochs=cfg.epochs, difficulty=cfg.difficulty,
                      keyed_sampling=cfg.keyed_sampling)
    epoch_requests = [build_requests(problems, prompt_ids, ab_cfg, stop_ids, epoch=e) for e in range(cfg.epochs)]
    if engine_factory is None:
        from verl_ext.vllm.local import VLLMInstanceFactory, dtype_engine_args

        engine_factory = VLLMInstanceFactory(str(model_dir), seed=cfg.seed, max_model_len=max_model_len(prompt_ids, ab_cfg),
                                             extra_engine_args=dtype_engine_args(cfg.dtype) or None,
                                             engine_log=cfg.engine_log)

    t_start = time.monotonic()
    rows, epoch_wall = await _record(cfg, engine_factory, epoch_requests, score, progress)
    meta = {
        "source": "real",
        "model": model_dir.name,
        "model_path": None if cfg.model is None else str(model_dir),  # None: the default model
        "tokenizer": model_dir.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "recorder": "verl-ext trace record",
        "strategy": cfg.strategy,
        "workload": {"name": "arith", "prompts": cfg.prompts, "seed": cfg.seed, "difficulty": cfg.difficulty},
        "samples": cfg.samples,
        "epochs": cfg.epochs,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "instances": cfg.instances,
        "seeds": {
            "workload": cfg.seed,
            "engine": cfg.seed,
            "sampling": cfg.seed,
            "per_request": "sampling * 1000003 + (epoch * prompts + prompt_index) * samples + sample_index "
            "(verl_ext.ab.runner.build_requests)",
            "keyed": cfg.keyed_sampling,
        },
        "epoch_wall_s": epoch_wall,
        "record_wall_s": round(time.monotonic() - t_start, 3),
        "token_times": "per response token: seconds from submit until the client received it; "
        "tokens received in one engine output share a time",
        "stop_token_ids": list(stop_ids),
        "engine": engine_factory.describe() if hasattr(engine_factory, "describe") else {},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "omp_threads": os.environ.get("OMP_NUM_THREADS")},
        "config": asdict(cfg),
    }
    trace = Trace.from_rows(rows, meta=meta)
    trace.validate()
    if cfg.out is not None:
        write_trace(trace, cfg.out)
    return trace


async def _record(cfg: RecordConfig, engine_factory, epoch_requests, score, progress: bool):
    from verl_ext.pipe.arms import make_arm
    from verl_ext.compare.run import run_strategy

    _, spec = make_arm(cfg.strategy, cfg.spec_k)
    created = await (engine_factory.create(cfg.instances, spec=spec) if spec else engine_factory.create(cfg.instances))
    instances = [TimedInstance(inst) for inst in created]
    rows: list[dict] = []
    wall: list[float] = []
    try:
        # one short request per instance first, so one-off start-up costs stay out of the timings
        warm = SamplingSpec(temperature=0.0, max_tokens=4)
        first = epoch_requests[0][0].prompt_ids
        await asyncio.gather(*(inst.generate(GenRequest(f"warmup-{inst.name}", "warmup", first, warm)) for inst in instances))
        for epoch, requests in enumerate(epoch_requests):
            for inst in instances:
                inst.times.clear()
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=len(requests), desc=f"epoch {epoch}", unit="req", leave=True)
            try:
                arm = await run_strategy(
                    make_arm(cfg.strategy, cfg.spec_k)[0], instances, requests, score, seed=cfg.seed,
                    on_finish=(bar.update if bar else None),
                )
            finally:
                if bar is not None:
                    bar.close()
            wall.append(round(float(arm.metrics.get("wall_s") or 0.0), 3))
            rows.extend(_epoch_rows(epoch, requests, arm, instances))
    finally:
        if getattr(engine_factory, "owns_instances", True):
            await asyncio.gather(*(inst.shutdown() for inst in instances), return_exceptions=True)
    return rows, wall


def _epoch_rows(epoch: int, requests, arm, instances: list[TimedInstance]) -> list[dict]:
    records = {}
    for rec in arm.pool.records:  # baseline: one record per request
        records.setdefault(rec.request_id, rec)
    t0 = min((r.submit_s for r in records.values()), default=0.0)
    times: dict = {}
    for inst in instances:
        times.update(inst.times)
    rows = []
    for req, comp, reward in zip(requests, arm.completions, arm.rewards):
        rec = records.get(req.request_id)
        rows.append(
            {
                "epoch": epoch,
                "step": epoch,
                "prompt_uid": req.group_id,
                "sample_index": req.sample_index,
                "prompt_ids": list(req.prompt_ids),
                "response_ids": list(comp.token_ids),
                "reward": reward,
                "finish_reason": comp.finish_reason,
                "instance": None if rec is None else rec.instance,
                "submit_s": None if rec is None else rec.submit_s - t0,
                "finish_s": None if rec is None else rec.finish_s - t0,
                "token_times": times.get(req.request_id),
            }
        )
    return rows
