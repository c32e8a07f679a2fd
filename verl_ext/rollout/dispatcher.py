"""The strategy host inside veRL: one async Ray actor that every agent-loop worker sends its
``generate`` calls to.

veRL's agent loops stay untouched (tokenisation, multi-turn tools, streaming reward, padding and
output order are veRL's own). Only the step "which server, and when" changes: instead of
``GlobalRequestLoadBalancer.acquire_server`` + ``server.generate``, ``StrategyLLMClient`` calls
``StrategyDispatcher.generate``, which hands the request to the selected strategy over
``ReplicaInstance`` wrappers of veRL's server handles.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from verl_ext.config.settings import VerlExtSettings
from verl_ext.engine.instance import FINISH_ABORT, KEYED_SEED, PRIOR_TOKENS_KEY, GenRequest, SamplingSpec
from verl_ext.pipe.defer import is_deferred, resume_deferred
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import make_strategy
from verl_ext.pipe.lifecycle import UNSET, Lifecycle
from verl_ext.rollout import server_metrics
from verl_ext.pipe.chunks import WHOLE_KEY
from verl_ext.rollout.replica_instance import BASE_LEN_KEY, KWARGS_KEY, SAMPLING_KEY, TOKEN_OUTPUT_KEY, ReplicaInstance

logger = logging.getLogger(__name__)


#: seconds between reads of the servers' load (``ReplicaInstance.refresh``) while requests run
LOAD_POLL_S = 0.5

#: seconds with no request in flight and no trajectory coming in after which a step's history is
#: checkpointed: veRL may save its own checkpoint after a step and exit (``trainer.save_freq``),
#: and a run resumed from it needs that step's responses, which the next step's start (where
#: the previous step is closed and checkpointed) never comes to write
HISTORY_QUIET_S = 2.0

#: prompt groups remembered for sample numbering (oldest forgotten first)
GROUP_CACHE_SIZE = 100_000

#: seconds a request deferred to the next training step (inter-step migration) waits for that
#: step before it resumes anyway: veRL starts no next step after its last one, and a validation
#: request whose prompt is also in the training batch must not wait for one
DEFER_WAIT_S = 60.0


def prompt_group_id(prompt_ids) -> str:
    """A prompt's key, from its tokens: what names it across steps (its history: veRL's ``uid`` is
    a fresh uuid every step) and, where veRL's ``uid`` does not reach the dispatcher, its GRPO group
    (the ``n`` samples of one prompt send the same prompt tokens). With the ``uid``
    (``verl_ext.rollout.trajectory``) the group is the prompt key and the uid, so that a prompt
    twice in a batch, or in overlapping async steps, makes two groups. Later turns of a
    multi-turn trajectory keep their first turn's group (``StrategyDispatcher._identify``).
    """
    h = hashlib.blake2b(digest_size=12)
    h.update(len(prompt_ids).to_bytes(4, "little"))
    for t in prompt_ids:
        h.update(int(t).to_bytes(4, "little", signed=True))
    return "p" + h.hexdigest()


def sample_key(sample_seed: int, step: Optional[int], prompt_key: str, ordinal: int) -> int:
    """The keyed-sampling seed of ``custom.verl_ext.sample_seed``: the ``ordinal``-th sample of the
    prompt ``prompt_key`` in training step ``step``."""
    h = hashlib.blake2b(f"{sample_seed}:{step}:{prompt_key}:{ordinal}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2  # 62 bits, as ``Strategy.keyed`` draws them


def _take_index(counts: OrderedDict, key) -> int:
    """The next index under ``key`` (0, 1, ...), counted in ``counts``, which forgets its least
    recently used keys beyond ``GROUP_CACHE_SIZE``."""
    index = counts.get(key, 0)
    counts[key] = index + 1
    counts.move_to_end(key)
    if len(counts) > GROUP_CACHE_SIZE:
        counts.popitem(last=False)
    return index


class _Ident(NamedTuple):
    """Who a request is: its group, its prompt key (``prompt_group_id`` of the first ``key_len``
    prompt tokens), its sample index in the group, the prompt length veRL first sent, and its
    ``sample_key`` where ``custom.verl_ext.sample_seed`` is set."""

    group_id: str
    prompt_key: str
    sample_index: int
    prompt_len: int
    key_len: int
    key: Optional[int] = None


class StrategyDispatcher:
    """Plain class; ``ray.remote(StrategyDispatcher)`` makes it an async actor.

    For strategies that read history (``Strategy.uses_history``, e.g. ``rhyme``) it also owns the
    history workers' client (``verl_ext.history``): the manager calls ``begin_step`` before each
    training step's rollout and the agent-loop side sends every finished trajectory to
    ``ingest``. History is keyed by ``prompt_group_id`` (veRL's ``uid`` is a fresh uuid every
    step, so it cannot find a prompt's previous epoch). A history failure costs drafts and
    length estimates only, never a request.
    """

    def __init__(self, settings: VerlExtSettings, servers: dict, max_tokens_default: Optional[int] = None,
                 max_num_seqs: Optional[int] = None, drafting: bool = False, history_dir: Optional[str] = None,
                 carries: bool = False, stop_ids: Sequence[int] = (), keyed_sampling: bool = False):
        """``drafting``: the servers run verl_ext's vLLM drafter (requests then carry their group
        and prompt key, and the strategy may load drafter state over ``collective_rpc``).
        ``history_dir``: the history workers' checkpoint directory (None: no checkpoints).
        ``carries``: the trainer is off-policy and streams samples into training as they finish
        (veRL's async trainers), so a request the strategy defers to the next training step
        (inter-step migration, ``verl_ext.pipe.defer``) is held here and resumed when the manager
        starts that step (``begin_step``); its ``generate`` call returns the whole response then.
        ``stop_ids``: the model's EOS ids (``verl_ext.rollout.finish.model_stop_ids``); where
        there are none (they could not be read), requests that stop on EOS are generated in one
        piece (``whole_reason``).
        ``keyed_sampling``: the servers key the samples of keyed requests (vLLM with verl_ext's
        plugin: ``verl_ext.vllm.keyed``); strategies that chunk, migrate or copy requests
        then key theirs (``Strategy.keyed``)."""
        self.settings = settings
        self.strategy = make_strategy(settings.strategy, settings.options)
        # a registered name, or the class name of one given by import path (module:Class)
        self._metric_name = type(self.strategy).name or type(self.strategy).__name__
        self._versions: dict[str, int] = {}  # request id -> oldest weight version of its outputs
        self._stop_ids_known = bool(stop_ids)
        self._whole: Counter = Counter()  # requests generated in one piece, by reason (``whole_reason``)
        self._load_watch: Optional[asyncio.Task] = None  # reads the servers' load (first request on)
        self._load_watch_ready: Optional[asyncio.Future] = None  # done after the first read
        self.pool = InstancePool(
            [ReplicaInstance(str(sid), h, max_tokens_default, max_num_seqs, drafting=drafting, versions=self._versions,
                             stop_ids=stop_ids, keyed_sampling=keyed_sampling)
             for sid, h in servers.items()],
            seed=settings.seed,
        )
        # veRL's server caps max_tokens at the rollout's response_length when it is absent
        self.max_tokens_default = max_tokens_default or (1 << 30)
        self._requests = 0
        self._output_tokens = 0
        # the rollout's span since the last ``metrics`` call: first call in, last response out
        self._first_in: Optional[float] = None
        self._last_out: Optional[float] = None
        self._rollout_end: Optional[float] = None  # the last response out (kept across metrics calls)
        self._spec = server_metrics.SpecCounters() if drafting else None
        self._drafting = drafting
        self._group_sizes: OrderedDict[str, int] = OrderedDict()  # group id -> samples seen
        # (step, prompt key) -> samples of that prompt seen in that step (``sample_key``'s ordinal)
        self._draws: OrderedDict[tuple, int] = OrderedDict()
        self._unseeded = 0  # sampled requests that ``sample_seed`` could not key (no keyed servers)
        # request id -> who it was, for requests that ended aborted: veRL's async trainers resume
        # them under the same id (FullyAsyncLLMServerClient)
        self._aborted: OrderedDict[str, _Ident] = OrderedDict()
        # request id -> who it was, for finished turns: veRL's multi-turn agent loops
        # (tool_agent_loop) send every turn of a trajectory under its first's id
        self._turns: OrderedDict[str, _Ident] = OrderedDict()
        self._resumed = self._later_turns = 0
        # inter-step migration: request id -> (Chunked state, future of its whole completion)
        self._parked: dict[str, tuple[Any, asyncio.Future]] = {}
        self._waiting: dict[str, asyncio.Future] = {}  # request id -> its future, for ``generate``
        self._carried: set = set()  # resumed deferred requests still running
        self._deferred = self._late = 0
        self.history = None
        self._capped_prompts = 0  # prompts whose history the shards' byte caps dropped
        self._warned_cap = False
        self._step: Optional[int] = None
        self._keyed_asked = keyed_sampling
        self._keyed_check: Optional[asyncio.Task] = None  # ``_confirm_keyed_sampling``, once
        self._keyed_unconfirmed = 0  # servers that did not confirm keyed sampling (then off on all)
        self._ingests: set = set()  # ingest calls still running
        self._checkpoint: Optional[asyncio.Task] = None
        self._quiet: Optional[asyncio.TimerHandle] = None  # the pending quiet-time checkpoint
        if self.strategy.uses_history:
            self.history = self._start_history(history_dir)
        self.life = Lifecycle(self.strategy, history=self.history if self.strategy.uses_history else UNSET,
                              carrier=self._carry if carries else UNSET)

    def _start_history(self, history_dir: Optional[str]):
        import uuid

        from verl_ext.history import HistoryClient
        from verl_ext.history.worker import ACTOR_PREFIX

        h = self.settings.history
        # actor names: a trainer restarted on a live cluster finds its own workers (same checkpoint
        # directory); two trainers on one cluster never share theirs
        tag = hashlib.blake2b((history_dir or uuid.uuid4().hex).encode(), digest_size=4).hexdigest()
        try:
            return HistoryClient(num_shards=h.shards if isinstance(h.shards, int) else 1, keep=h.keep, max_bytes=h.max_bytes, checkpoint_dir=history_dir,
                                 num_cpus=h.num_cpus, nice=h.nice, timeout_s=h.timeout_s,
                                 namespace_prefix=f"{ACTOR_PREFIX}_{tag}").start()
        except Exception as exc:  # no history workers: the strategy runs without history
            logger.error("verl_ext: could not start the history workers (%s: %s); '%s' runs without history",
                         type(exc).__name__, exc, self.settings.strategy)
            return None

    async def begin_step(self, step: int, requests: Optional[int] = None, overlap: bool = False) -> None:
        """Training step ``step`` starts, with ``requests`` requests (where the manager knows it)
        and ``overlap``: the trainer overlaps it with the previous step's training: close the
        previous step in the history (growth rates), checkpoint it every
        ``history.checkpoint_every`` steps, and tell the strategy."""
        step = int(step)
        if step == self._step:
            return
        await self._keyed_confirmed()
        prev, self._step = self._step, step
        if self.history is not None and prev is not None:
            await self._drain_ingests()
            await self.history.close_step(prev)
            await self._check_history_cap()
            if self._checkpoints(prev):
                self._start_checkpoint()
        # from the last response of the previous rollout to this step's start: what veRL's
        # trainer spent between the two (reward, log-probs, update, weight sync)
        train_s = time.monotonic() - self._rollout_end if prev is not None and self._rollout_end is not None else None
        self.life.begin_step(step, train_s, requests=requests, instances=len(self.pool.instances), overlap=overlap)
        for rid in list(self._parked):  # deferred in an earlier step: resume in this one
            self._resume(rid)

    async def _keyed_confirmed(self) -> None:
        """Wait for ``_confirm_keyed_sampling`` (started by the first step or request)."""
        if not self._keyed_asked:
            return
        if self._keyed_check is None:
            self._keyed_check = asyncio.ensure_future(self._confirm_keyed_sampling())
        await asyncio.shield(self._keyed_check)

    async def _confirm_keyed_sampling(self) -> None:
        """Once, before the first rollout: ask every server what its engine runs
        (``ReplicaInstance.engine_report``). Where keyed sampling was expected and a server does
        not confirm it (the plugin did not take in its processes: another vLLM build, a moved hook
        point, ``VERL_EXT_VLLM_PLUGIN=0`` there), it is off on every server, with a warning and
        ``verl_ext/keyed_sampling/unconfirmed_servers``: strategies then neither key, copy nor
        draft sampled requests, rather than race copies that are not the same sample."""
        servers = list(self.pool.instances.values())
        await asyncio.gather(*(inst.engine_report() for inst in servers))
        missing = [inst.name for inst in servers if not inst.keyed_sampling]
        self._keyed_unconfirmed = len(missing)
        if missing:
            for inst in servers:
                inst.keyed_sampling = False
            logger.warning("verl_ext: server(s) %s did not confirm keyed sampling; '%s' samples unkeyed on every server "
                           "(no copies or drafts of sampled requests). `verl-ext doctor` says what verl_ext sees",
                           ", ".join(missing), self.settings.strategy)

    async def engine_reports(self) -> dict[str, Optional[dict]]:
        """Each server's ``engine_report`` (what its engine runs: vLLM, ISA, kernel library, keyed
        sampling's rule), as confirmed before the first rollout (asked now if none has run)."""
        await self._keyed_confirmed()
        return {name: inst.engine_info for name, inst in self.pool.instances.items()}

    async def _check_history_cap(self) -> None:
        """Warn once when a history shard has dropped a prompt's whole history to stay under its
        cap: that prompt comes back (next epoch) without one."""
        try:
            st = await self.history.stats()
        except Exception:
            return
        self._capped_prompts = int(st.get("capped_prompts", 0))
        if self._capped_prompts and not self._warned_cap:
            self._warned_cap = True
            h = self.settings.history
            logger.warning("verl_ext: the history shards dropped %d prompts' history to stay under %d x %.2f GiB "
                           "(history.shards x history.max_bytes; %.2f GiB held): those prompts come back without "
                           "HistoSpec drafts or HistoPipe lengths; raise history.max_bytes or history.shards",
                           self._capped_prompts, self.history.num_shards, h.max_bytes / 2**30,
                           st.get("bytes_held", 0) / 2**30)

    # -- inter-step migration ------------------------------------------------------------------------
    def _carry(self, st) -> None:
        """The strategy defers ``st`` (a ``Chunked`` state) to the next training step."""
        rid = st.request.request_id
        loop = asyncio.get_running_loop()
        fut = self._waiting[rid] = loop.create_future()
        self._parked[rid] = (st, fut)
        self._deferred += 1
        loop.call_later(DEFER_WAIT_S, self._resume, rid, True)

    def _resume(self, rid: str, late: bool = False) -> None:
        entry = self._parked.pop(rid, None)
        if entry is None:
            return
        if late:
            self._late += 1
            logger.warning("verl_ext: request %s, deferred to the next training step, waited %.0f s for it and "
                           "resumes now", rid, DEFER_WAIT_S)
        task = asyncio.ensure_future(self._run_resumed(*entry))
        self._carried.add(task)
        task.add_done_callback(self._carried.discard)

    async def _run_resumed(self, st, fut: asyncio.Future) -> None:
        """Runs ``resume_deferred`` and hands its completion (or error) to the waiting ``generate``."""
        try:
            result = await resume_deferred(st, self.pool)
            if not fut.done():
                fut.set_result(result)
        except BaseException as exc:
            if not fut.done():
                fut.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def ingest(self, step: int, items: Sequence[tuple]) -> int:
        """Finished trajectories of step ``step`` for the history workers: ``items`` are
        ``(prompt_key, sample_index, response_ids, reward)`` (reward None or NaN when unscored)."""
        if self.history is None or not items:
            return 0
        from verl_ext.history import Trajectory

        rows = [Trajectory(str(k), int(step), int(i), np.asarray(r, dtype=np.int32),
                           None if rw is None or not np.isfinite(rw) else float(rw)) for k, i, r, rw in items]
        task = asyncio.ensure_future(self.history.ingest(rows))
        self._ingests.add(task)
        try:
            return await task
        finally:
            self._ingests.discard(task)
            if self._checkpoints(step):
                self._arm_checkpoint()

    def _checkpoints(self, step: int) -> bool:
        """Whether step ``step``'s history is checkpointed (``history.checkpoint_dir``, every
        ``history.checkpoint_every`` steps)."""
        return (self.history is not None and bool(self.history.worker_args.get("checkpoint_dir"))
                and step % self.settings.history.checkpoint_every == 0)

    def _arm_checkpoint(self) -> None:
        """(Re)start the quiet-time clock: the step's history is checkpointed once
        ``HISTORY_QUIET_S`` pass with no request in flight and no trajectory coming in."""
        if self._quiet is not None:
            self._quiet.cancel()
        self._quiet = asyncio.get_running_loop().call_later(HISTORY_QUIET_S, self._checkpoint_when_quiet)

    def _checkpoint_when_quiet(self) -> None:
        self._quiet = None
        if self._ingests or any(self.pool.inflight.values()):
            self._arm_checkpoint()
        else:
            self._start_checkpoint()

    def _start_checkpoint(self) -> None:
        """Checkpoint the history workers, after the checkpoint still being written (if any), so
        that the last one holds everything ingested so far."""
        running = self._checkpoint if self._checkpoint is not None and not self._checkpoint.done() else None

        async def write():
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
            await self.history.checkpoint()

        self._checkpoint = asyncio.ensure_future(write())

    async def _drain_ingests(self) -> None:
        if self._ingests:
            await asyncio.wait(list(self._ingests), timeout=self.settings.history.timeout_s)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict,
                       verl_ext_uid: Optional[str] = None, **kwargs: Any):
        """Same arguments as veRL's ``server.generate`` (plus the caller's sticky ``request_id``),
        and the trajectory's ``uid`` where the agent-loop worker knows it."""
        if self._first_in is None:
            self._first_in = time.monotonic()
        if self._load_watch is None:
            self._load_watch_ready = asyncio.get_running_loop().create_future()
            self._load_watch = asyncio.ensure_future(self._watch_load())
        await asyncio.shield(self._load_watch_ready)  # the first read only
        await self._keyed_confirmed()
        params = dict(sampling_params)
        if self._drafting:
            refused = undraftable_reason(params)
            if refused is not None:
                raise ValueError(
                    f"verl_ext: request {request_id} sets {refused}, which vLLM does not serve on engines with speculative "
                    f"decoding (its verification cannot apply it at draft positions), and strategy "
                    f"'{self.settings.strategy}' runs the rollout servers with verl_ext's drafter. Drop the setting, "
                    "or start the servers without the drafter (`~actor_rollout_ref.rollout.engine_kwargs.vllm."
                    "speculative_config`, and the strategy's drafting option off, e.g. options.speculative=false)")
        max_tokens = params.get("max_tokens", params.get("max_new_tokens", self.max_tokens_default))
        ident = self._identify(request_id, prompt_ids, verl_ext_uid)
        prompt_len = ident.prompt_len
        # a request that comes keyed (an agent loop's own ``extra_args["verl_ext"]["keyed_seed"]``)
        # keeps its key through every strategy, where the servers confirmed keyed sampling
        key = ((params.get("extra_args") or {}).get("verl_ext") or {}).get(KEYED_SEED)
        temperature = float(params.get("temperature", 1.0))
        if key is None and ident.key is not None and temperature > 0:
            if self.pool.keyed_sampling:
                key = ident.key
            else:  # said once, counted always: these samples will differ from run to run
                if not self._unseeded:
                    logger.warning("verl_ext: custom.verl_ext.sample_seed is set but the rollout servers do not key "
                                   "samples (see verl_ext/keyed_sampling/unconfirmed_servers); requests sample "
                                   "unkeyed, so runs do not draw the same samples")
                self._unseeded += 1
        keyed = key is not None and self.pool.keyed_sampling
        seed = int(key) if keyed else (None if params.get("seed") is None else int(params["seed"]))
        request = GenRequest(
            request_id=request_id,
            group_id=ident.group_id,
            prompt_key=ident.prompt_key,
            prompt_ids=prompt_ids,
            sample_index=ident.sample_index,
            sampling=SamplingSpec(
                temperature=temperature,
                top_p=float(params.get("top_p", 1.0)),
                top_k=int(params.get("top_k", -1)),
                max_tokens=int(max_tokens),
                seed=seed,
                keyed=keyed,
            ),
            extra={SAMPLING_KEY: params, KWARGS_KEY: kwargs, BASE_LEN_KEY: len(prompt_ids)},
        )
        reason = whole_reason(params, self._stop_ids_known)
        if reason is not None:
            request.extra[WHOLE_KEY] = True
            if not self._whole[reason]:
                logger.warning("verl_ext: requests with %s are generated in one piece (strategy '%s' does not divide, "
                               "copy or move them: a continuation could not keep them exact)", reason,
                               self.settings.strategy)
            self._whole[reason] += 1
        if len(prompt_ids) > prompt_len:  # a resumed request: its response so far ends its prompt
            request.extra[PRIOR_TOKENS_KEY] = len(prompt_ids) - prompt_len
        try:
            completion = await self.strategy.submit(request, self.pool)
            if is_deferred(completion):  # resumed at the next training step (``begin_step``)
                try:
                    completion = await self._waiting.pop(request_id)
                except asyncio.CancelledError:  # the caller gave up: do not resume it
                    self._parked.pop(request_id, None)
                    raise
        finally:
            oldest = self._versions.pop(request_id, None)
        self._requests += 1
        self._output_tokens += len(completion.token_ids)
        self._last_out = self._rollout_end = time.monotonic()
        table = self._aborted if completion.finish_reason == FINISH_ABORT else self._turns
        table[request_id] = ident
        table.move_to_end(request_id)
        if len(table) > GROUP_CACHE_SIZE:
            table.popitem(last=False)
        out = merged_token_output(completion)
        if oldest is not None and oldest != out.extra_fields.get("global_steps"):
            # chunks generated under different weights: veRL's staleness metrics read the oldest
            out.extra_fields["min_global_steps"] = oldest
        return out

    async def _watch_load(self) -> None:
        """Read every server's load once before the first request (strategies size their
        admission by the KV capacity), then every ``LOAD_POLL_S`` while requests run; stop for
        good when no server serves load metrics (``disable_log_stats=true``, veRL's default)."""
        instances = list(self.pool.instances.values())
        try:
            read = await asyncio.gather(*(i.refresh() for i in instances))
        finally:
            self._load_watch_ready.set_result(None)
        if not any(read) or not any(i.telemetry().steps or i.telemetry().kv_capacity_tokens for i in instances):
            logger.info("verl_ext: the rollout servers serve no load metrics; strategies see in-flight counts only")
            return
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            if any(self.pool.inflight.values()):
                await asyncio.gather(*(i.refresh() for i in instances))

    def _identify(self, request_id: str, prompt_ids: list[int], uid: Optional[str] = None) -> _Ident:
        """Who a request is. A request that comes back after an abort (veRL's async trainers
        resend ``prompt + tokens so far`` under the same ``request_id``) keeps its group and sample
        index, and so does a later turn of a multi-turn trajectory (same ``request_id``, its prompt
        extends the first turn's), so that group drafts, length estimates and history follow the
        trajectory. Any other request is a new sample of its group: its prompt key and ``uid``
        (veRL's GRPO group), or its prompt key alone where no uid came."""
        known = self._aborted.pop(request_id, None)
        if known is not None:
            if len(prompt_ids) >= known.prompt_len and prompt_group_id(prompt_ids[:known.key_len]) == known.prompt_key:
                self._resumed += 1
                return known
        turn = self._turns.pop(request_id, None)
        if turn is not None:
            if len(prompt_ids) > turn.key_len and prompt_group_id(prompt_ids[:turn.key_len]) == turn.prompt_key:
                self._later_turns += 1
                return turn._replace(prompt_len=len(prompt_ids))
        prompt_key = prompt_group_id(prompt_ids)
        group_id = prompt_key if uid is None else f"{prompt_key}:{uid}"
        sample_index = _take_index(self._group_sizes, group_id)
        key = None
        seed = self.settings.sample_seed
        if seed is not None:  # the prompt's samples in this step, in any arrival order, get the same keys
            key = sample_key(seed, self._step, prompt_key, _take_index(self._draws, (self._step, prompt_key)))
        return _Ident(group_id, prompt_key, sample_index, len(prompt_ids), len(prompt_ids), key)

    async def metrics(self, reset: bool = True) -> dict[str, float]:
        """Dispatcher counters since the last call, prefixed for veRL's tracking; with verl_ext's
        drafter on the servers, also what they drafted and accepted (their ``/metrics``); and
        ``verl_ext/mechanisms/<name>``: how many times each of the strategy's mechanisms acted
        over the run so far (``verl_ext.pipe.mechanisms``)."""
        out = self._counters(reset)
        if self._spec is not None:
            readings = await asyncio.to_thread(server_metrics.read_all, list(self.pool.instances))
            out.update(self._spec.step(readings) if reset else {})
        # over the run so far (verl_ext.pipe.mechanisms); the drafters' counters with verl_ext's drafter
        got = await self.life.mechanisms(self.pool.instances.values() if self._spec is not None else ())
        out.update({f"verl_ext/mechanisms/{k}": float(v) for k, v in got.items()})
        return out

    def _counters(self, reset: bool) -> dict[str, float]:
        out = {
            "verl_ext/requests": float(self._requests),
            "verl_ext/output_tokens": float(self._output_tokens),
            "verl_ext/resumed": float(self._resumed),
            "verl_ext/later_turns": float(self._later_turns),
            "verl_ext/deferred": float(self._deferred),
            "verl_ext/deferred_waited_out": float(self._late),
            # veRL's timing_s/gen also counts its trainer's polling (V1's replay buffer: every 2 s)
            "verl_ext/rollout_s": (self._last_out - self._first_in if self._last_out is not None
                                   and self._first_in is not None else 0.0),
            **{f"verl_ext/{self._metric_name}/{k}": float(v) for k, v in self.strategy.metrics().items()},
        }
        for name, count in self.pool.inflight.items():
            out[f"verl_ext/inflight/{name}"] = float(count)
        if self._keyed_asked:
            out["verl_ext/keyed_sampling/unconfirmed_servers"] = float(self._keyed_unconfirmed)
        if self.settings.sample_seed is not None:  # over the run so far
            out["verl_ext/sample_seed/unkeyed_requests"] = float(self._unseeded)
        for reason, count in self._whole.items():  # over the run so far
            out[f"verl_ext/whole/{reason.replace(' ', '_')}"] = float(count)
        loads = [i.telemetry() for i in self.pool.instances.values()]
        if any(t.kv_capacity_tokens for t in loads):  # what the servers' load metrics say (ReplicaInstance.refresh)
            out["verl_ext/load/kv_capacity_tokens"] = float(sum(t.kv_capacity_tokens or 0 for t in loads))
            out["verl_ext/load/engine_steps"] = float(sum(t.steps for t in loads))
        if self.history is not None:
            out.update({f"verl_ext/history/{k}": float(v) for k, v in self.history.metrics().items()})
            out["verl_ext/history/capped_prompts"] = float(self._capped_prompts)
        if reset:
            self._requests = self._output_tokens = self._resumed = self._deferred = self._late = self._later_turns = 0
            self._first_in = self._last_out = None
        return out


#: sampling parameters whose state a continuation (a chunk, a Best-of-N copy, a move: prompt +
#: tokens so far, sent as a new request) would restart or could not see, and the reason named in
#: the warning and in ``verl_ext/whole/<reason>``: vLLM counts penalties over one call's output,
#: matches stop strings and bad words within one call's text and tokens, and restarts structured
#: output's grammar at each call
_WHOLE_PARAMS = (
    (("presence_penalty", "frequency_penalty"), "presence or frequency penalties"),
    (("stop",), "stop strings"),
    (("bad_words",), "bad words"),
    (("structured_outputs", "guided_decoding", "response_format"), "structured output"),
)


#: sampling settings that vLLM refuses on an engine with speculative decoding (vLLM 0.32's
#: ``SamplingParams._validate_spec_decode``; it builds no logits processor for them there)
_UNDRAFTABLE_PARAMS = ("min_p", "logit_bias")


def undraftable_reason(params: dict) -> Optional[str]:
    """The setting of ``params`` that an engine running a drafter cannot serve, or None. Every
    other setting vLLM applies at draft positions too (penalties, bad words, allowed token ids,
    ``min_tokens``; temperature, top-k and top-p through the keyed rule), before verification."""
    for key in _UNDRAFTABLE_PARAMS:
        if params.get(key):
            return f"{key}={params[key]!r}"
    return None


def whole_reason(params: dict, stop_ids_known: bool = True) -> Optional[str]:
    """Why a veRL request with sampling ``params`` must be generated in one piece, or None. Also
    where the model's EOS ids are unknown (``model_stop_ids`` read none) and EOS is not ignored: a
    part that ends on EOS exactly at its budget would be taken as cut off and continued."""
    for keys, reason in _WHOLE_PARAMS:
        if any(params.get(k) for k in keys):
            return reason
    if not stop_ids_known and not params.get("ignore_eos"):
        return "unknown EOS ids"
    return None


#: the ``stop_reason`` of an aborted response: veRL's vLLM server, its SGLang server
_ABORTED = ("aborted", "abort")


def merged_token_output(completion):
    """veRL's ``TokenOutput`` for a completion: the last engine call's output, with the whole
    response's tokens and log-probs wherever the completion holds more than that call generated
    (chunks of a divided request, a Best-of-N copy spliced after the prefix it resumed from, a
    migrated request), and ``stop_reason="completed"`` where the last call was aborted but the
    completion finished. Raises rather than hand the trainer a response whose log-probs do not
    cover every token."""
    out = completion.extra[TOKEN_OUTPUT_KEY]
    tokens = list(completion.token_ids)
    update: dict[str, Any] = {}
    if out.stop_reason in _ABORTED and completion.finish_reason != FINISH_ABORT:
        # a move whose abort came with the last token (rlhfspec): the sample is finished, and veRL's
        # async client would resend one that says "aborted" (vLLM servers say "completed" for stop and
        # length alike; SGLang's say which)
        update["stop_reason"] = "completed" if out.stop_reason == "aborted" else completion.finish_reason
    if list(out.token_ids) == tokens:
        return out.model_copy(update=update) if update else out
    if out.routed_experts is not None:
        raise RuntimeError(
            "this request was generated in parts (chunks, a copy or a move), and its routed experts (MoE routing "
            "replay) cannot be joined across them; turn chunking off (custom.verl_ext.options.chunk_size=0) and "
            "copies off (options.best_of_n=false) with routing replay"
        )
    logprobs = completion.logprobs
    if out.log_probs is not None and (logprobs is None or len(logprobs) != len(tokens)):
        raise RuntimeError(
            f"request {completion.request_id}: generated in parts, and the log-probs of {len(tokens)} response "
            f"tokens are not all known ({'none' if logprobs is None else len(logprobs)}); refusing to hand the "
            "trainer a partial sample"
        )
    return out.model_copy(update={**update, "token_ids": tokens, "log_probs": logprobs})
