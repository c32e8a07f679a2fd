"""veRL-facing rollout manager: ``agent.agent_loop_manager_class=verl_ext.rollout.manager.VerlExtAgentLoopManager``.

veRL 0.9.1 builds the manager with ``cls.create(config=, llm_client=, teacher_client=,
reward_loop_worker_handles=)`` in three trainers: the V1 trainer (``trainer.use_v1=true``, the
default; ``verl/trainer/main_ppo.py``, which enables TransferQueue), the legacy V0
``RayPPOTrainer`` (``verl/trainer/ppo/ray_trainer.py``) and the one-step-off-policy trainer
(``python -m verl.experimental.one_step_off_policy.main_ppo``: rollout of step N+1 overlaps
training of step N). ``VerlExtAgentLoopManager.create`` returns the matching subclass: of
``AgentLoopManagerTQ`` (V1, outputs go to TransferQueue) or of ``AgentLoopManager`` (V0 and
one-step-off, ``generate_sequences`` returns a ``DataProto``).

Both subclasses keep veRL's agent loops and workers. The only change is the LLM client handed to
the workers: ``StrategyLLMClient`` sends each ``generate`` to the ``StrategyDispatcher`` actor,
where the selected strategy picks the server and the timing. If the dispatcher dies, the client
logs an error once and falls back to veRL's own load balancer, so a rollout is never lost.

Before each training rollout the manager tells the dispatcher the step and how many requests
it brings (``begin_step``). For strategies that read history (``rhyme``), every finished
trajectory goes to the history workers through the dispatcher's ``ingest``: from the V0 output
``DataProto`` here, from the agent-loop workers' post-processing in V1
(``verl_ext.rollout.workers_v1``), where the manager never sees the outputs. Validation rollouts
feed nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Optional

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

from verl_ext.config.check import check_drafter_config, runs_verl_ext_drafter
from verl_ext.config.settings import VerlExtSettings
from verl_ext.pipe.strategy import StrategyConfigError, get_strategy_class
from verl_ext.rollout.dispatcher import StrategyDispatcher, prompt_group_id
from verl_ext.rollout.verl_compat import client_load_balancer, server_handles
from verl_ext.rollout.finish import model_stop_ids
from verl_ext.rollout.trajectory import TRAJECTORY_UID
from verl_ext.rollout import trace_hook
from verl_ext.vllm.versions import keyed_sampling_supported

logger = logging.getLogger(__name__)


class _TracingClient(LLMServerClient):
    """Adds per-request trace info (``custom.verl_ext.trace``) to what the rest of the client
    returns; outermost, so that it sees the whole response of a resumed request."""

    def __init__(self, config, load_balancer_handle=None, trace=None, stop_ids=(), **kwargs):
        super().__init__(config, load_balancer_handle=load_balancer_handle, **kwargs)
        self.verl_ext_stop_ids = tuple(stop_ids)  # the model's EOS ids, for the finish reason
        #: (V1 collector handle or None, TraceSettings, response_length) when traces are recorded
        self.verl_ext_trace = trace

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs: Any):
        if self.verl_ext_trace is None:
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        submit_t = time.time()
        output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        try:  # per-request trace info; the trace hook removes it before veRL stores the output
            output.extra_fields[trace_hook.TRACE_KEY] = trace_hook.request_info(
                output, sampling_params, self.verl_ext_trace[2], submit_t, time.time(), self.verl_ext_stop_ids
            )
        except Exception as exc:
            logger.error("verl_ext: no trace info for request %s (%s)", request_id, exc)
        return output


class _DispatchingClient(LLMServerClient):
    """Sends one ``generate`` (one attempt) to the ``StrategyDispatcher`` instead of veRL's load
    balancer; if the dispatcher is gone, to veRL's own ``LLMServerClient.generate``."""

    def __init__(self, config, load_balancer_handle=None, dispatcher=None, history=False, **kwargs):
        super().__init__(config, load_balancer_handle=load_balancer_handle, **kwargs)
        self._dispatcher = dispatcher
        self._dispatcher_failed = False
        #: the dispatcher, when finished trajectories feed the history workers (V1 workers read it)
        self.verl_ext_history = dispatcher if history else None

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs: Any):
        if self._dispatcher is None or self._dispatcher_failed:
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        forwarded = {k: v for k, v in kwargs.items() if v is not None}
        uid = TRAJECTORY_UID.get()  # set by verl_ext's agent-loop workers
        try:
            output = await self._dispatcher.generate.remote(request_id, list(prompt_ids), dict(sampling_params),
                                                            verl_ext_uid=uid, **forwarded)
        except ray.exceptions.RayActorError as exc:
            if not self._dispatcher_failed:  # once per worker, not once per call that was in flight
                self._dispatcher_failed = True
                logger.error("verl_ext dispatcher is gone (%s); falling back to veRL's load balancer for this worker",
                             exc)
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        steps = output.extra_fields.get("global_steps")
        output.extra_fields.setdefault("min_global_steps", steps)
        output.extra_fields.setdefault("max_global_steps", steps)
        self._attempt_done(request_id, output)
        return output

    def _attempt_done(self, request_id, output) -> None:
        """Hook for clients that run several attempts per request."""


class StrategyLLMClient(_TracingClient, _DispatchingClient):
    """``LLMServerClient`` whose requests are scheduled by verl_ext's dispatcher (veRL's
    synchronous trainers)."""


class StrategyFullyAsyncLLMClient(_TracingClient, FullyAsyncLLMServerClient, _DispatchingClient):
    """The same for veRL's async trainers (``trainer.v1.trainer_mode=colocate_async|separate_async``),
    whose weight syncs abort every request in flight: veRL's ``FullyAsyncLLMServerClient`` loop
    resumes an aborted request (prompt + tokens so far, the budget left), and each attempt goes
    through the dispatcher (method order: trace, resume loop, dispatch, veRL's load balancer).
    The dispatcher knows a resumed request by its ``request_id`` (veRL keeps it across attempts)
    and keeps its group and sample index.

    veRL's loop takes a request's oldest weight version from its first attempt's ``global_steps``
    (the version at that attempt's end); an attempt of a strategy that generates in chunks
    (``seer``) can span a weight sync (a chunk waiting between two others is not aborted), so the
    oldest version any chunk reported (the dispatcher's ``min_global_steps``) is kept here."""

    def __init__(self, config, load_balancer_handle=None, **kwargs):
        super().__init__(config, load_balancer_handle=load_balancer_handle, **kwargs)
        self._oldest: dict = {}  # request id -> oldest min_global_steps of its attempts

    def _attempt_done(self, request_id, output) -> None:
        v = output.extra_fields.get("min_global_steps")
        if v is not None:
            self._oldest[request_id] = min(self._oldest.get(request_id, v), v)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs: Any):
        try:
            output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        finally:
            oldest = self._oldest.pop(request_id, None)
        first = output.extra_fields.get("min_global_steps")
        if oldest is not None and first is not None and oldest < first:
            output.extra_fields["min_global_steps"] = oldest
        return output


def _with_history_shards(settings, config):
    """``settings`` with ``history.shards: auto`` resolved to what an epoch's history needs
    (``verl_ext.history.capacity``); a warning where it does not fit, or cannot be sized."""
    from verl_ext.history.capacity import MAX_AUTO_SHARDS, dataset_prompts, epoch_history_bytes, plan_shards

    h = settings.history
    if h.shards != "auto":
        return settings
    data = config.get("data") or {}
    rollout = config.actor_rollout_ref.rollout
    prompts = dataset_prompts(data.get("train_files"), data.get("train_max_samples"))
    tokens = data.get("max_response_length") or rollout.get("response_length") or 0
    need = epoch_history_bytes(prompts, rollout.get("n") or 1, tokens, h.keep) if prompts and tokens else None
    shards, fits = plan_shards(need, h.max_bytes)
    if need is None:
        logger.warning("verl_ext: history.shards=auto cannot size an epoch's history (the training files are not "
                       "local Parquet files): one shard of %.1f GiB; the dispatcher warns if it drops a prompt's "
                       "history", h.max_bytes / 2**30)
    elif not fits:
        logger.warning("verl_ext: an epoch's history needs about %.1f GiB (%d prompts x %d samples x %d tokens), more "
                       "than history.shards=auto's %d shards x %.1f GiB (history.max_bytes): prompts will lose their "
                       "history before their next epoch; raise history.max_bytes or set history.shards",
                       need / 2**30, prompts, rollout.get("n") or 1, tokens, MAX_AUTO_SHARDS, h.max_bytes / 2**30)
    else:
        logger.info("verl_ext: %d history shard(s) for an epoch's history of about %.1f GiB", shards, need / 2**30)
    return dataclasses.replace(settings, history=dataclasses.replace(h, shards=shards))


class _VerlExtManagerMixin:
    """Builds the dispatcher and swaps the workers' LLM client; the rest is veRL's manager."""

    _verl_ext_flavour = "v0"

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        rollout = config.actor_rollout_ref.rollout
        # veRL's async trainers hand over a FullyAsyncLLMServerClient: they abort requests at weight
        # syncs (resumed by that client's loop) and stream finished samples into training
        async_trainer = isinstance(llm_client, FullyAsyncLLMServerClient)
        self._verl_ext_overlap = async_trainer  # rollouts overlap training (one-step-off: seen below)
        self.verl_ext_settings = VerlExtSettings.from_custom(rollout.get("custom"), async_trainer=async_trainer)
        self.verl_ext_trace_recorder = None  # V0
        self.verl_ext_trace_collector = None  # V1
        trace = self._verl_ext_setup_trace(config)
        load_balancer = client_load_balancer(llm_client)
        servers = server_handles(load_balancer)
        check_drafter_config(self.verl_ext_settings, rollout)
        strategy_cls = get_strategy_class(self.verl_ext_settings.strategy)
        self.verl_ext_history = strategy_cls.uses_history
        history_dir = None
        if self.verl_ext_history:
            trainer = config.get("trainer") or {}
            history_dir = self.verl_ext_settings.history.resolve_dir(trainer.get("default_local_dir"))
            self.verl_ext_settings = _with_history_shards(self.verl_ext_settings, config)
        model = config.actor_rollout_ref.model
        stop_ids = sorted(model_stop_ids(model.path, bool(model.get("trust_remote_code", False))))
        self.verl_ext_dispatcher = (
            ray.remote(StrategyDispatcher)
            .options(num_cpus=0, max_concurrency=100_000)
            .remote(self.verl_ext_settings, servers, rollout.get("response_length"), rollout.get("max_num_seqs"),
                    drafting=runs_verl_ext_drafter(rollout), history_dir=history_dir, carries=async_trainer,
                    stop_ids=stop_ids, keyed_sampling=rollout.get("name") == "vllm" and keyed_sampling_supported())
        )
        client_kwargs = dict(load_balancer_handle=load_balancer, dispatcher=self.verl_ext_dispatcher, trace=trace,
                             stop_ids=stop_ids, history=self.verl_ext_history)
        if async_trainer:  # resume aborted requests
            client = StrategyFullyAsyncLLMClient(config, only_hybrid=getattr(llm_client, "_only_hybrid", False),
                                                 **client_kwargs)
        else:
            client = StrategyLLMClient(config, **client_kwargs)
        logger.warning(
            "verl_ext: rollout strategy '%s' over %d server(s)%s", self.verl_ext_settings.strategy, len(servers),
            f"; history workers checkpoint to {history_dir}" if history_dir else "",
        )
        super().__init__(config, client, teacher_client, reward_loop_worker_handles)
        # after veRL's __init__, which sets the worker class: verl_ext's workers tell the client
        # each trajectory's uid (its GRPO group), record traces and, in V1, feed the history
        self.agent_loop_workers_class = ray.remote(self._verl_ext_worker_cls(trace is not None))
        if self._verl_ext_flavour == "v1":  # V0 returns them in meta_info["timing"]
            from verl_ext.rollout import v1_metrics

            v1_metrics.add_source(self.verl_ext_metrics)

    def _verl_ext_begin_step(self, step, validate: bool, requests: Optional[int] = None):
        """Tell the dispatcher which training step the next requests belong to, and how many
        requests it will send (``requests``, the batch's samples, where known); returns that step
        (None for validation or where the trainer gives none).

        veRL's trainers pass ``meta_info["global_steps"]``. The one-step-off-policy trainer
        starts generation k + 1 before step k ends, so it passes 1 to generations 1 and 2, and
        k - 1 to generation k: a training generation whose step is not past the last one's is
        the next step (else HistoPipe would replan nothing and the history would file two
        generations under one step); from then on the dispatcher is told that rollouts overlap
        training, as under veRL's async trainers. veRL 0.9's synchronous trainers generate once
        per step."""
        if validate or step is None:
            return None
        step = int(step)
        last = getattr(self, "_verl_ext_last_step", None)
        if last is not None and step <= last:
            step = last + 1
            self._verl_ext_overlap = True
        self._verl_ext_last_step = step
        try:
            ray.get(self.verl_ext_dispatcher.begin_step.remote(int(step), requests, self._verl_ext_overlap),
                    timeout=self.verl_ext_settings.history.timeout_s * 3)
        except Exception as exc:  # the strategy then plans with the previous step's view
            logger.error("verl_ext: could not start step %s in the dispatcher (%s: %s)", step, type(exc).__name__, exc)
        return step

    def _verl_ext_setup_trace(self, config):
        """Trace recording (``custom.verl_ext.trace``): None when off; see ``verl_ext.rollout.trace_hook``."""
        settings = self.verl_ext_settings.trace
        if not settings.enabled:
            return None
        directory = trace_hook.prepare_dir(settings.dir)
        if directory is None:
            return None
        meta = trace_hook.base_meta(config, self.verl_ext_settings, self._verl_ext_flavour)
        if self._verl_ext_flavour == "v1":
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
            self.verl_ext_trace_collector = (
                ray.remote(trace_hook.StepTraceCollector).options(num_cpus=0, scheduling_strategy=node).remote(directory, meta)
            )
        else:
            self.verl_ext_trace_recorder = trace_hook.V0Recorder(directory, settings.every, meta)
        logger.warning("verl_ext: recording rollout traces to %s (every %d step(s))", directory, settings.every)
        response_length = trace_hook._int_or_none(config.actor_rollout_ref.rollout.get("response_length"))
        return (self.verl_ext_trace_collector, settings, response_length)

    def verl_ext_metrics(self) -> dict[str, float]:
        try:
            return ray.get(self.verl_ext_dispatcher.metrics.remote())
        except Exception as exc:  # metrics must never break a step
            logger.warning("verl_ext: no dispatcher metrics (%s)", exc)
            return {}


class VerlExtAgentLoopManagerV0(_VerlExtManagerMixin, AgentLoopManager):
    """Legacy trainer (``trainer.use_v1=false``): ``generate_sequences`` returns a ``DataProto``."""

    @staticmethod
    def _verl_ext_worker_cls(tracing: bool):
        from verl_ext.rollout.workers_v0 import TracingAgentLoopWorker, TrajectoryAgentLoopWorker

        return TracingAgentLoopWorker if tracing else TrajectoryAgentLoopWorker

    @auto_await
    async def generate_sequences(self, prompts):
        meta = prompts.meta_info or {}
        validate = bool(meta.get("validate", False))
        step = self._verl_ext_begin_step(meta.get("global_steps"), validate, len(prompts))
        output = await super().generate_sequences(prompts)
        if self.verl_ext_history and not validate:
            self._verl_ext_feed_history(step, prompts, output)
        # veRL's V0 trainer merges meta_info["timing"] into the step's logged metrics.
        output.meta_info.setdefault("timing", {}).update(self.verl_ext_metrics())
        if self.verl_ext_trace_recorder is not None:
            self.verl_ext_trace_recorder.record(prompts, output)  # never raises
        return output

    def _verl_ext_feed_history(self, step, prompts, output) -> None:
        """Send the step's trajectories to the history workers (through the dispatcher; not awaited)."""
        try:
            step = int(step if step is not None else -1)
            t = trace_hook.trace_from_dataproto(output, step, prompts=prompts)
            items = [(prompt_group_id(t.prompt(i)), int(t.sample_index[i]), t.response(i), float(t.reward[i]))
                     for i in range(len(t))]
            self.verl_ext_dispatcher.ingest.remote(step, items)
        except Exception as exc:  # history is an optimisation: never break a step
            logger.error("verl_ext: could not feed this step to the history workers (%s: %s)", type(exc).__name__, exc)


@functools.cache
def _v1_cls():
    # Lazy: the V1 module needs the TransferQueue package, which the V0 trainer does not.
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    class VerlExtAgentLoopManagerTQ(_VerlExtManagerMixin, AgentLoopManagerTQ):
        _verl_ext_flavour = "v1"

        @staticmethod
        def _verl_ext_worker_cls(tracing: bool):
            from verl_ext.rollout.workers_v1 import TracingAgentLoopWorkerTQ

            return TracingAgentLoopWorkerTQ

        def generate_sequences(self, prompts):
            if self.verl_ext_trace_collector is not None:
                self._verl_ext_expect(prompts)
            keys = set(prompts.keys())
            validate = "validate" in keys and bool(prompts["validate"])
            # one row per prompt, rollout.n samples each (unknown where rows set their own n)
            requests = None if "__rollout_n__" in keys else len(prompts) * int(self.config.actor_rollout_ref.rollout.n)
            self._verl_ext_begin_step(int(prompts["global_steps"]) if "global_steps" in keys else None, validate,
                                      requests)
            return super().generate_sequences(prompts)

        def _verl_ext_expect(self, prompts) -> None:
            """Register the batch's prompts with the trace collector before dispatching them."""
            try:
                keys = set(prompts.keys())
                if "validate" in keys and bool(prompts["validate"]):
                    return
                step = int(prompts["global_steps"]) if "global_steps" in keys else -1
                if self.verl_ext_settings.trace.records(step):
                    uids = [str(u) for u in prompts["uid"]]
                    ray.get(self.verl_ext_trace_collector.expect.remote(step, uids), timeout=120)
            except Exception as exc:  # tracing must never break a rollout
                logger.error("verl_ext: could not register prompts for tracing (%s: %s)", type(exc).__name__, exc)

    return VerlExtAgentLoopManagerTQ


class VerlExtAgentLoopManager:
    """Factory named by ``agent.agent_loop_manager_class``; ``create`` returns the right subclass."""

    @classmethod
    def manager_cls(cls, config) -> type:
        trainer = config.get("trainer") or {}
        # V1 is veRL's main_ppo with trainer.use_v1=true, which turns TransferQueue on before it
        # builds the manager. The V0 trainer and the one-step-off-policy trainer
        # (verl.experimental.one_step_off_policy, whose config inherits use_v1=true but not
        # TransferQueue) take a DataProto back from generate_sequences.
        transfer_queue = bool((config.get("transfer_queue") or {}).get("enable", False))
        use_v1 = bool(trainer.get("use_v1", True)) and transfer_queue
        mode = (trainer.get("v1") or {}).get("trainer_mode", "sync") if use_v1 else "sync"
        if mode not in ("sync", "colocate_async", "separate_async"):
            raise StrategyConfigError(
                f"verl_ext rollout managers support veRL 0.9's trainer.v1.trainer_mode=sync|colocate_async|"
                f"separate_async, not '{mode}'; drop agent.agent_loop_manager_class to run veRL's own manager")
        if mode == "separate_async" and bool((config.get("actor_rollout_ref") or {}).get("hybrid_engine", True)):
            # separate_async lends the trainer's GPUs to rollout between steps by adding and removing
            # hybrid replicas in veRL's load balancer; the dispatcher routes over the servers it read
            # from the balancer at start-up, so it would never use (or would use removed) replicas
            raise StrategyConfigError(
                "verl_ext rollout managers route over a fixed set of servers; trainer.v1.trainer_mode=separate_async "
                "with hybrid replicas (actor_rollout_ref.hybrid_engine=true, the default) adds and removes servers "
                "between steps. Set actor_rollout_ref.hybrid_engine=false (standalone rollout servers only), or use "
                "trainer_mode=colocate_async or sync")
        # Async modes abort every request in flight at a weight sync and resume it afterwards:
        # the workers' client is then StrategyFullyAsyncLLMClient (chosen from veRL's client type).
        return _v1_cls() if use_v1 else VerlExtAgentLoopManagerV0

    @classmethod
    def create(cls, config, llm_client, teacher_client: Optional[dict] = None, reward_loop_worker_handles=None):
        return cls.manager_cls(config).create(
            config=config,
            llm_client=llm_client,
            teacher_client=teacher_client,
            reward_loop_worker_handles=reward_loop_worker_handles,
        )
