"""``specactor``: SpecActor's rollout.

* Initial selection (section 4.2, ``verl_ext.spec.ladder``): each training step, the ladder
  (``options.ladder`` or built from ``options.profile``) picks the method with the best speedup
  at its historical acceptance and the per-worker batch, or plain decoding.
* Methods on real engines are model-free suffix-tree scope sets (``suffix``, ``ngram``), chosen
  per request (``spec_scopes``) on engines started with their union; draft-model methods are
  planned and simulated only.
* Decoupled plan (section 4.1, Algorithm 1, ``verl_ext.spec.tgs``): computed and reported; engines
  run coupled speculation with per-request windows (``spec_window``), since neither vLLM nor
  SGLang has a decoupled mode (``metrics()['decoupled_engine']`` is 0).
* Reconfiguration (Algorithm 2, ``reconfigure``): every ``cooldown`` engine steps, requests whose
  inferred acceptance is below the average get the best window for their own rate
  (``Instance.set_spec_windows``).
* Best-of-N (section 4.2, Algorithm 3, ``verl_ext.pipe.specactor.bon``): freed instances run copies of the
  lowest-acceptance requests with other methods; the first copy to finish wins, the others are
  aborted. Lossless only where copies emit the same tokens: greedy requests, and sampled requests
  keyed by position (``Strategy.keyed``: on engines with ``keyed_sampling``); other sampled
  requests are refused copies (``bon_refused_sampled``).

Rationale, knobs and metrics: docs/papers/specactor.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from verl_ext.engine.instance import FINISH_ABORT, Completion, GenRequest, Instance
from verl_ext.pipe.specactor.bon import assign_best_of_n
from verl_ext.pipe.chunks import is_whole
from verl_ext.pipe.pool import BurstClock, InstancePool
from verl_ext.pipe.strategy import Strategy, StrategyConfigError, register_strategy
from verl_ext.spec.ladder import ENGINE_LADDER_PREFIX

logger = logging.getLogger(__name__)

#: decision polls before the engines' step time is known, seconds
FIRST_POLL_S = 0.05
#: this project's drafting methods on real engines (suffix-tree scopes) and their default
#: historical acceptance rates, measured on the committed trace (docs/BENCHMARKS.md, specactor)
DEFAULT_METHODS = (("suffix", "request+group", 0.21), ("ngram", "request", 0.24))


@dataclass(frozen=True)
class SpecActorOptions:
    """Knobs of ``rollout=specactor`` (``custom.verl_ext.options``)."""

    #: speculate at all (false: plain decoding, no copies)
    speculation: bool = True
    #: draft ladder JSON (``verl-ext fit ladder``); "" = built from ``profile``
    ladder: str = ""
    #: the engines' cost model (preset or ``verl-ext fit grid`` JSON) to build the ladder, plan and
    #: compute the batch cut-off from when ``ladder`` is ""; "" = the one A/B runs and the
    #: simulator pass (``--preset``)
    profile: str = ""
    #: coupled engines draft nothing in a step whose batch is above the cut-off for their measured
    #: acceptance (``verl_ext.spec.cutoff``, from the cost model): the ladder's windows are chosen
    #: from the step's batch at the historical rate; the cut-off re-checks each step at the
    #: engines' measured rate
    batch_cutoff: bool = True
    #: historical acceptance overriding the ladder's, "method=rate,method=rate"
    acceptance: str = ""
    #: per-worker batch at the start of a step for the initial selection when the strategy sees
    #: requests one at a time and is not told their number; A/B runs and the simulator use
    #: requests / instances, and so does veRL's dispatcher, which knows the step's batch
    batch: int = 64
    #: GPUs per verifier (instance) for the decoupled plan's report
    verify_gpus: int = 1
    #: most draft tokens per request (the engines' ``k``); windows are at most this
    spec_k: int = 16
    #: Best-of-N copies for the tail (greedy and keyed sampled requests: see the module docstring)
    best_of_n: bool = True
    #: Algorithm 2 on running requests: every ``cooldown`` engine steps, requests below the
    #: average acceptance get the best window for their own rate (engines with set_spec_windows)
    reconfigure: bool = True
    #: most requests an instance verifies with copies on it (Algorithm 3's b_max); 0 = 8
    b_max: int = 0
    #: engine steps between two Best-of-N decisions
    cooldown: int = 8
    #: tokens a request must have generated before it may get a copy (its rate is measured)
    min_tokens: int = 16
    #: how the engines speculate: "coupled" (draft, then verify: vLLM) or "decoupled" (draft
    #: models on GPUs of their own, pipelined with verification: the simulator's
    #: SyntheticDrafter only); windows and the plain-decoding decision follow the TGS model of it
    execution: str = "coupled"
    #: the engines can draft the ladder's draft-model methods per request
    #: (``GenRequest.extra["spec_method"]``): the simulator's ``SyntheticDrafter``; a vLLM engine
    #: speculates with one method, so real engines use the suffix methods only
    model_methods: bool = False
    #: with execution=decoupled, Algorithm 2 also picks each below-average request's mode: the
    #: better of its best coupled and best decoupled window at b = 1 (lines 3-5). Off by default:
    #: measured slower in the simulator (docs/BENCHMARKS.md), since a coupled request's draft
    #: steps run before every verification of its whole batch, which the b = 1 model leaves out
    switch_modes: bool = False

    def __post_init__(self):
        for name in ("speculation", "best_of_n", "reconfigure", "model_methods", "switch_modes", "batch_cutoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not 1 <= self.spec_k <= 128:
            raise ValueError(f"spec_k must be in [1, 128], got {self.spec_k}")
        if self.verify_gpus < 1:
            raise ValueError(f"verify_gpus must be >= 1, got {self.verify_gpus}")
        if self.b_max < 0 or self.cooldown < 1 or self.min_tokens < 0 or self.batch < 1:
            raise ValueError("b_max and min_tokens must be >= 0, cooldown and batch >= 1")
        parse_acceptance(self.acceptance)
        if self.execution not in ("coupled", "decoupled"):
            raise ValueError(f"execution must be 'coupled' or 'decoupled', got {self.execution!r}")
        if self.switch_modes and self.execution != "decoupled":
            raise ValueError("switch_modes needs execution=decoupled (requests can only switch out of decoupled mode)")


@functools.lru_cache(maxsize=1 << 16)
def acceptance_from_tokens(tokens_per_step: float, window: int, decoupled: bool = False) -> float:
    """The per-token acceptance ``p`` at which speculation with ``window`` draft tokens emits
    ``tokens_per_step`` on average, by bisection to 2^-40 (both are increasing in ``p``); clipped
    to [0, 1]. Coupled: ``tau_coupled(p, w) = (1 - p^(w+1)) / (1 - p)``. Decoupled (a round after
    each rejection verifies stale drafts and emits one token): ``(tau_coupled + r) / (1 + r)``,
    ``r = 1 - p^w``. Cached: the rates of running requests are read every few engine steps, from
    token and step counts that repeat."""
    from verl_ext.spec.tgs import tau_coupled

    def tau(p):
        t = tau_coupled(p, window)
        return (t + 1 - p ** window) / (2 - p ** window) if decoupled else t

    if window <= 0 or tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= window + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if tau(mid) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def parse_acceptance(text: str) -> dict[str, float]:
    """``"suffix=0.3,ngram=0.2"`` -> ``{"suffix": 0.3, "ngram": 0.2}``."""
    out = {}
    for part in filter(None, (p.strip() for p in str(text or "").split(","))):
        name, sep, val = part.partition("=")
        try:
            p = float(val)
        except ValueError:
            p = -1.0
        if not sep or not name.strip() or not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance must be 'method=rate,...' with rates in [0, 1], got {text!r}")
        out[name.strip()] = p
    return out


class _Run:
    """One copy of a request on one instance (the original is the first)."""

    __slots__ = ("instance", "method", "task", "prefix", "steps0", "tokens", "original", "window", "rate", "decoupled",
                 "mark")

    def __init__(self, instance: Instance, method: Optional[str], prefix: list, steps0: int, original: bool = False,
                 window: int = 0, decoupled: bool = False):
        self.original = original
        self.window = window  # its draft window (spec_window)
        self.decoupled = decoupled  # its execution mode (Algorithm 2 may switch it to coupled)
        self.rate: Optional[float] = None  # its acceptance when last measured while drafting
        self.instance = instance
        self.method = method
        self.task: Optional[asyncio.Task] = None
        self.prefix = prefix  # tokens of the request before this copy started
        self.steps0 = steps0  # engine steps the request had run before this copy started
        self.tokens: list = []  # streamed tokens of this copy (streaming engines)
        self.mark = (0, 0)  # the request's (tokens, engine steps) when this run's window was last set


class _Live:
    __slots__ = ("request", "runs", "deltas", "added")

    def __init__(self, request: GenRequest):
        self.request = request
        self.runs: list[_Run] = []
        self.deltas = 0  # the original's streamed deltas (~ engine steps)
        self.added = asyncio.Event()  # a copy started: the wait for the first finisher includes it

    @property
    def original(self) -> Optional[_Run]:
        """The request's original run while it runs (None once it has ended or failed)."""
        return next((r for r in self.runs if r.original), None)


@register_strategy("specactor")
class SpecActorStrategy(Strategy):
    keys_samples = True  # Best-of-N copies of a sampled request emit the same tokens
    mechanisms = {
        "window_changes": "strategy",  # Algorithm 2: draft windows of running requests reconfigured
        "ladder_selections": "strategy",  # the draft ladder's method and window chosen for a step's batch
        "bon_copies": "strategy",  # Algorithm 3: Best-of-N copies started (greedy requests)
    }
    Options = SpecActorOptions

    def parts_options(self) -> list[str]:
        return ["best_of_n"] if self.options.best_of_n else []

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self._cost = None
        self._ladder = None
        if o.profile:
            from verl_ext.perf.cost import load_cost_model

            try:
                self._cost = load_cost_model(o.profile)
            except (OSError, ValueError) as exc:
                raise StrategyConfigError(f"strategy 'specactor': profile: {exc}") from exc
        if o.ladder:
            from verl_ext.spec.ladder import DraftLadder, LadderError

            try:
                self._ladder = DraftLadder.load(o.ladder)
            except LadderError as exc:
                raise StrategyConfigError(f"strategy 'specactor': {exc}") from exc
            if o.execution == "decoupled" and not o.profile and self._ladder.target.startswith(ENGINE_LADDER_PREFIX):
                raise StrategyConfigError(
                    f"strategy 'specactor': execution=decoupled plans from the verifier's cost model, and the ladder "
                    f"{o.ladder} was measured on an engine ({self._ladder.target}); set options.profile to that "
                    f"engine's cost model, or use a `verl-ext fit ladder PRESET` ladder")
        self._history = parse_acceptance(o.acceptance)
        self._method: Optional[str] = None  # the initial selection (None: plain decoding)
        self._engine_drafts: Optional[bool] = None  # whether the engines were started with a drafter
        self._engine_gain: Optional[float] = None  # DraftLadder.drafter_gain when they were started
        self._plan = None
        self._selected = False  # this step's initial selection is made
        self._expected: Optional[int] = None  # the step's per-instance batch, where the driver tells it
        self._tail_method: Optional[str] = None  # the best method for a lone request
        self._dec_cache: dict = {}  # decoupled execution: (method, p, batch) -> (window, speedup)
        self._step_batch = 1  # per-instance batch the step was selected at
        self._live: dict[str, _Live] = {}
        self._worker_method: dict[str, str] = {}  # instances given a method by Best-of-N
        self._loop_task: Optional[asyncio.Task] = None
        self._clock = BurstClock()  # where this burst's engine steps start to be timed
        self._warned_sampled = False
        self._m = Counter()

    # -- ladder, selection and plan ----------------------------------------------------------
    def ladder(self, cost=None):
        """The draft ladder: ``options.ladder``, else built from the engines' cost model."""
        if self._ladder is None:
            cost = self._cost or cost
            if cost is None:
                raise StrategyConfigError(
                    "strategy 'specactor' needs a draft ladder: set options.ladder (`verl-ext fit ladder`) or "
                    "options.profile (a cost-model preset such as h100-7b, or a `verl-ext fit grid` JSON)")
            from verl_ext.spec.ladder import SUFFIX_DRAFT_S, DraftLadder, DraftMethod

            # the proposal's cost from its fit, not timed here: a run's choices depend on its inputs only
            methods = [DraftMethod(n, "suffix", p, scopes=s, draft_s=SUFFIX_DRAFT_S) for n, s, p in DEFAULT_METHODS]
            self._ladder = DraftLadder.build(cost, methods, verify_gpus=self.options.verify_gpus,
                                             max_window=self.options.spec_k)
        return self._ladder

    def _usable(self, lad) -> list[str]:
        """Methods the engines can draft per request: suffix-tree scopes, and draft models with
        ``model_methods`` (the simulator)."""
        kinds = ("suffix", "model") if self.options.model_methods else ("suffix",)
        return [n for n, m in lad.methods.items() if m.kind in kinds]

    def select(self, batch: int, cost=None) -> Optional[str]:
        """The initial selection at a per-worker ``batch`` (None: plain decoding)."""
        from verl_ext.spec.ladder import pick

        lad = self.ladder(cost)
        ranked = self._rank(batch)
        self._method = pick(ranked)
        # plain decoding at the step's batch: requests still carry the method that pays for a
        # lone request (window 0), so that reconfiguration can turn it on as the batch drains
        self._tail_method = self._method or pick(self._rank(1))
        self._m["selected_speedup"] = ranked[0][1] if ranked else 0.0
        self.acted["ladder_selections"] += 1
        self._m["selected_method"] = -1 if self._method is None else list(lad.methods).index(self._method)
        self._m["selection_batch"] = batch
        return self._method

    def _rank(self, batch: int) -> list:
        """(method, speedup) best first at the methods' historical acceptance: the ladder's
        coupled table, or the decoupled TGS model with ``execution="decoupled"``."""
        lad = self.ladder()
        if self.options.execution != "decoupled":
            return lad.rank(batch, self._history, self._usable(lad))
        got = [(n, self._speedup(n, self._history.get(n, lad.methods[n].acceptance), batch)) for n in self._usable(lad)]
        return sorted(got, key=lambda x: -x[1])

    def engine_spec(self, cost=None):
        """Engines draft (the union of the usable methods' scopes, per-request windows) when some
        method beats plain decoding for a lone request, the tail, and (coupled execution) drafting
        is expected to save more than an engine with a drafter costs while nothing is drafted
        (``DraftLadder.drafter_gain`` from ``options.batch`` down to 1; the idle cost is known
        for ladders measured on the engine, ``verl-ext fit engine-ladder``); each step's
        initial selection then decides the windows at the step's batch (0: no drafts). Else the
        engines decode plainly, as ``baseline``'s do, and no Best-of-N copies are made."""
        o = self.options
        if self._cost is None:
            self._cost = cost
        if not o.speculation:
            self._engine_drafts = False
            return None
        tail = self.select(1, cost)
        lad = self.ladder()
        # the coupled table prices an engine's idle cost; decoupled drafters are the simulator's
        gain = lad.drafter_gain(o.batch, self._history, self._usable(lad)) if o.execution == "coupled" else None
        self._engine_gain = gain
        self._engine_drafts = tail is not None and (gain is None or gain > 0.0)
        self._method = None  # each step selects at its own batch
        if not self._engine_drafts:
            if tail is not None:
                logger.info("specactor: plain engines: from %d requests per worker down to 1, drafting with %s is "
                            "expected to change the decode time by %+.1f%% against engines without a drafter (ladder "
                            "%s, with the drafting engine's idle cost); inside veRL the engines' drafter is "
                            "engine_kwargs.vllm.speculative_config", o.batch, tail, -100 * gain, lad.target)
            return None
        from verl_ext.spec.options import SpecOptions

        lad = self.ladder()
        scopes = "+".join(sorted({s for n in self._usable(lad) for s in lad.methods[n].scopes.split("+")}))
        from verl_ext.spec.cutoff import cutoff_table

        # the table prices verification on the engine's own step: decoupled drafters are not
        cutoffs = cutoff_table(self._cost) if (o.batch_cutoff and o.execution == "coupled") else ()
        return SpecOptions(scopes=scopes, k=o.spec_k, batch_cutoffs=cutoffs)

    def _plan_for(self, batch: int, gpus: int) -> None:
        """Algorithm 1 for the selected method (reported; engines run coupled)."""
        if self._method is None or (self._cost is None and self.options.profile == ""):
            return
        from verl_ext.spec.tgs import plan_decoupled

        lad = self.ladder()
        m = lad.methods[self._method]
        p = self._history.get(self._method, m.acceptance)
        try:
            t = m.times(self._cost, verify_gpus=self.options.verify_gpus)
            self._plan = plan_decoupled([t], batch, gpus, p, cap=self.options.spec_k)
        except Exception as exc:  # a report only: never fail the rollout over it
            logger.warning("specactor: no decoupled plan (%s)", exc)
            return
        self._m.update({"plan_g_d": self._plan.g_d, "plan_g_v": self._plan.g_v, "plan_w": self._plan.w,
                        "plan_speedup": self._plan.speedup})

    def begin_step(self, step: int) -> None:
        """A new step: metrics restart, and the step selects its method again."""
        self._m = Counter()
        self._worker_method.clear()
        self._selected = False
        self._expected = None

    def expect_requests(self, requests: int, instances: int) -> None:
        """The step's requests over its instances (veRL's dispatcher): the initial selection is
        made at that per-instance batch, as ``rollout`` makes it, instead of ``options.batch``."""
        self._expected = -(-requests // max(1, instances))

    def _window(self, method: Optional[str], p: Optional[float], batch: int) -> int:
        if method is None:
            return 0
        lad = self.ladder()
        if p is None:
            p = self._history.get(method, lad.methods[method].acceptance)
        if self.options.execution == "decoupled":
            return self._decoupled(method, p, batch)[0]
        return max(1, min(self.options.spec_k, lad.best_window(method, p, batch)))

    def _speedup(self, method: str, p: float, batch: int) -> float:
        """The method's speedup over plain decoding at ``p`` and ``batch`` for this execution."""
        if self.options.execution == "decoupled":
            return self._decoupled(method, p, batch)[1]
        return self.ladder().lookup(method, p, batch)

    def _decoupled(self, method: str, p: float, batch: int) -> tuple[int, float]:
        """(best decoupled window, its speedup over plain decoding) from the method's TGS times
        against the ladder's verifier (one drafter GPU) at ``batch``, cached per p (to 0.01)."""
        key = (method, round(p, 2), max(1, int(batch)))
        got = self._dec_cache.get(key)
        if got is None:
            from verl_ext.spec.tgs import DECOUPLED

            t = self._times(method)
            w, tgs = t.best_window(key[1], key[2], DECOUPLED, g_d=1, w_max=self.options.spec_k)
            got = self._dec_cache[key] = (w, tgs / t.tgs_plain(key[2]))
        return got

    def _times(self, method: str):
        """The method's TGS times (``verl_ext.spec.tgs.SpecTimes``) against the ladder's verifier."""
        if self._cost is None:
            from verl_ext.perf.cost import load_cost_model

            self._cost = load_cost_model(self.ladder().target)
        return self.ladder().methods[method].times(self._cost, verify_gpus=self.options.verify_gpus)

    def _lone_request_plan(self, method: str, p: float) -> tuple[int, bool]:
        """Algorithm 2, lines 3-5, in decoupled execution: the better of the best coupled and the
        best decoupled window for a lone request (``b = 1``) at rate ``p``: (window, decoupled)."""
        from verl_ext.spec.tgs import COUPLED, DECOUPLED

        t = self._times(method)
        w_c, t_c = t.best_window(p, 1, COUPLED, w_max=self.options.spec_k)
        w_d, t_d = t.best_window(p, 1, DECOUPLED, g_d=1, w_max=self.options.spec_k)
        return (w_d, True) if t_d > t_c else (w_c, False)

    def _with_plan(self, request: GenRequest, method: Optional[str], window: int) -> GenRequest:
        if not self._engine_drafts:
            return request
        m = self.ladder().methods[method] if method is not None else None
        extra = {**request.extra, "spec_window": int(window)}
        if m is not None and m.kind == "suffix" and m.scopes:
            extra["spec_scopes"] = m.scopes
        if method is not None:
            extra["spec_method"] = method
        return dataclasses.replace(request, extra=extra)

    # -- dispatch ----------------------------------------------------------------------------
    async def submit(self, request: GenRequest, pool: InstancePool) -> Completion:
        request = self.keyed(request, pool)
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"specactor: request id {rid} is already running")
        if self._engine_drafts is None:  # inside veRL, engine_spec ran in another process
            self.engine_spec()
        if not self._selected:
            self._selected = True
            self._step_batch = self._expected or self.options.batch
            if self._engine_drafts:
                self.select(self._step_batch)
        inst = pool.least_loaded(rid)
        live = self._live[rid] = _Live(request)
        # the window for the batch the instance will run: the step's per-instance batch (its
        # first requests arrive to an empty engine that the rest of the step fills)
        batch = max(1, pool.inflight[inst.name] + 1, self._step_batch)
        method = self._method or (self._tail_method if self.options.reconfigure else None)
        window = self._window(self._method, None, batch)  # 0 while plain decoding pays more
        run = _Run(inst, method, [], 0, original=True, window=window,
                   decoupled=self.options.execution == "decoupled")
        self._start(live, run, self._with_plan(request, method, window), pool)
        self._ensure_loop(pool)
        try:
            return await self._finish(live, pool)
        finally:
            del self._live[rid]
            for r in live.runs:
                if r.task is not None and not r.task.done():
                    r.task.cancel()

    def _start(self, live: _Live, run: _Run, req: GenRequest, pool: InstancePool) -> None:
        def on_tokens(delta, run=run):
            run.tokens.extend(delta)
            if run.original:
                live.deltas += 1

        run.task = pool.start(run.instance, req, on_tokens=on_tokens)  # in flight now: the next submit sees it
        live.runs.append(run)
        live.added.set()

    async def _finish(self, live: _Live, pool: InstancePool) -> Completion:
        """Wait for the first copy to finish (not aborted), abort the others, and return the
        request's completion (the winner's tokens after its prefix)."""
        winner: Optional[tuple[_Run, Completion]] = None
        last_abort: Optional[Completion] = None
        while winner is None:
            pending = [r.task for r in live.runs if not r.task.done()]
            if pending:
                live.added.clear()
                added = asyncio.ensure_future(live.added.wait())
                try:  # wake on a finisher, or on a new copy (which may finish first)
                    await asyncio.wait([*pending, added], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    added.cancel()
            for r in list(live.runs):
                if not r.task.done():
                    continue
                try:
                    c = r.task.result()
                except Exception as exc:
                    if len(live.runs) == 1:
                        raise
                    logger.warning("specactor: a copy of %s on %s failed (%s); the others go on",
                                   live.request.request_id, r.instance.name, exc)
                    self._m["bon_failed"] += 1
                    live.runs.remove(r)
                    continue
                if c.finish_reason != FINISH_ABORT:
                    winner = (r, c)
                    break
                last_abort = c
                live.runs.remove(r)
            if winner is None and not live.runs:
                return last_abort  # aborted from outside: every copy is gone
        run, c = winner
        losers = [r for r in live.runs if r is not run]
        for r in losers:
            try:
                await r.instance.abort(live.request.request_id)
            except Exception:
                pass
        results = await asyncio.gather(*(r.task for r in losers), return_exceptions=True)
        if run.original:
            return c
        self._m["bon_wins"] += 1
        original = next((x for r, x in zip(losers, results) if r.original and isinstance(x, Completion)), None)
        return self._splice(live, run, c, original)

    def _splice(self, live: _Live, run: _Run, c: Completion, original: Optional[Completion]) -> Completion:
        L = len(run.prefix)
        tokens = list(run.prefix) + list(c.token_ids)
        logprobs = None
        if c.logprobs is not None and original is not None and original.logprobs is not None and len(original.logprobs) >= L:
            logprobs = list(original.logprobs[:L]) + list(c.logprobs)
        if original is not None:
            n = min(len(original.token_ids), len(tokens))
            if list(original.token_ids[:n]) != tokens[:n]:
                self._m["bon_divergent"] += 1  # copies of a greedy request disagreed (engine numerics)
        steps = None if c.num_steps is None else run.steps0 + c.num_steps
        return Completion(live.request.request_id, tokens, c.finish_reason, logprobs=logprobs, num_steps=steps,
                          extra={**c.extra, "bon_method": run.method, "bon_instance": run.instance.name})

    # -- Best-of-N ---------------------------------------------------------------------------
    def _bon_on(self, pool: InstancePool) -> bool:
        return self.options.best_of_n and len(pool.instances) >= 2 and len(self._usable(self.ladder())) >= 1

    def _ensure_loop(self, pool: InstancePool) -> None:
        o = self.options
        if not (o.speculation and self._engine_drafts):
            return
        if not (self._bon_on(pool) or o.reconfigure):
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._bon_loop(pool))

    async def _bon_loop(self, pool: InstancePool) -> None:
        """Every ``cooldown`` engine steps: Algorithm 2 on the running requests, then Algorithm 3."""
        self._clock.clear()  # a new burst of requests: engine steps are timed afresh
        poll = FIRST_POLL_S
        while self._live:
            await asyncio.sleep(poll)
            step_s = self._step_seconds(pool)
            if step_s:
                poll = max(1e-4, self.options.cooldown * step_s)
            # engines that do not stream: the rates need token counts so far
            self._m["progress_failed"] += await pool.refresh_progress()
            if self.options.reconfigure:
                await self._reconfigure_running(pool)
            if not self._bon_on(pool):
                continue
            t0 = time.perf_counter()
            try:
                copies = self._decide(pool)
            except Exception as exc:  # never let a bad decision break the rollout
                logger.warning("specactor: Best-of-N decision failed (%s); no copies this round", exc)
                copies = []
            self._m["bon_decisions"] += 1
            self._m["bon_decision_s"] += time.perf_counter() - t0
            for live, method, inst, prefix, steps0, window in copies:
                if live.request.request_id not in self._live or any(r.instance is inst for r in live.runs):
                    continue
                if prefix is None:  # known by count only (a reading without tokens): read them now
                    prefix, steps0 = await self._read_prefix(live)
                    if prefix is None or live.request.request_id not in self._live:
                        continue
                req = self._copy_request(live.request, prefix, method, window)
                if req is None:
                    continue
                copy = _Run(inst, method, prefix, steps0, window=window, decoupled=self.options.execution == "decoupled")
                self._start(live, copy, req, pool)
                self._m["bon_copies"] += 1
                self.acted["bon_copies"] += 1

    async def _read_prefix(self, live: _Live) -> tuple[Optional[list], int]:
        """The tokens so far and engine steps of a request's original run, read from its instance
        with the tokens (``refresh_progress(tokens=True)``): a copy resumes from them."""
        run = live.original
        fn = getattr(run.instance, "refresh_progress", None) if run is not None else None
        if fn is None:
            return None, 0
        try:
            await fn([live.request.request_id], tokens=True)
        except Exception:
            return None, 0
        _, tokens, steps = self._progress(live, tokens=True)
        return tokens, steps

    def _rate(self, live: _Live, fallback: Optional[str], progress: Optional[tuple] = None):
        """(acceptance per draft token, token count so far, steps so far) of a request's original run,
        or None before ``min_tokens``. The rate is the one whose tokens per step at the run's
        current window (``execution``'s model) match those since that window was set (the engines
        report no per-request counts); until ``min_tokens`` have come at it, or while the run
        decodes plainly (window 0), it is the run's last measured rate, else the method's
        historical acceptance. ``progress``: ``_progress(live)`` where the caller has it."""
        count, _, steps = progress if progress is not None else self._progress(live)
        if count is None or count < self.options.min_tokens or steps <= 0:
            return None
        run = live.original
        if run is None:
            return None
        n, k = count - run.mark[0], steps - run.mark[1]
        if run.window > 0 and n >= self.options.min_tokens and k > 0:
            return acceptance_from_tokens(n / k, run.window, run.decoupled), count, steps
        if run.rate is not None:
            return run.rate, count, steps
        method = run.method or fallback
        if method is None:
            return None
        return self._history.get(method, self.ladder().methods[method].acceptance), count, steps

    async def _reconfigure_running(self, pool: InstancePool) -> None:
        """Algorithm 2 on running requests: a request whose measured acceptance is below the
        average of those measured gets the best window for its own rate at ``b = 1`` (as
        ``verl_ext.spec.tgs.reconfigure``); the others keep theirs. Where the step decodes plainly
        (the initial selection found no method that pays at the step's batch), a request's window
        opens, for the method that pays for a lone request, once its instance's batch has drained
        to where that method pays. Changed windows go to the engines in one ``set_spec_windows``
        call each (engines without it keep theirs)."""
        from verl_ext.spec.ladder import MIN_SPEEDUP

        lad = self.ladder()
        runs = []
        for rid, live in self._live.items():
            run = live.original
            if run is None or run.method is None:
                continue
            if run.window > 0:  # measured while it drafts
                got = self._rate(live, run.method)
                run.rate = got[0] if got is not None else run.rate
            runs.append((rid, run))
        measured = [run.rate for _, run in runs if run.rate is not None]
        mean = sum(measured) / len(measured) if measured else 0.0
        changes: dict = {}
        for rid, run in runs:
            mode = run.decoupled
            if self._method is None:  # plain at the step's batch: open where the tail method pays
                hist = self._history.get(run.method, lad.methods[run.method].acceptance)
                b = max(1, pool.inflight[run.instance.name])
                w = self._window(run.method, None, b) if self._speedup(run.method, hist, b) >= MIN_SPEEDUP else 0
            elif run.rate is not None and len(measured) >= 2 and run.rate < mean:
                if self.options.switch_modes:  # Algorithm 2: the better of coupled and decoupled
                    w, mode = self._lone_request_plan(run.method, run.rate)
                else:
                    w = self._window(run.method, run.rate, 1)
            else:
                continue
            if w != run.window or mode != run.decoupled:
                changes.setdefault(run.instance.name, {})[rid] = (w, mode, run)
        for name, ws in changes.items():
            inst = pool.instances[name]
            fn = getattr(inst, "set_spec_windows", None)
            if fn is None:
                continue
            windows = {rid: w for rid, (w, _, _) in ws.items()}
            try:
                if self.options.switch_modes:  # only the simulator models decoupled execution
                    n = await fn(windows, {rid: "decoupled" if m else "coupled" for rid, (_, m, _) in ws.items()})
                else:
                    n = await fn(windows)
            except Exception as exc:  # a window is an optimisation: keep the old one
                logger.warning("specactor: could not reconfigure windows on %s (%s)", name, exc)
                continue
            for rid, (w, m, run) in ws.items():
                self._m["switched_coupled"] += run.decoupled and not m
                self._m["switched_decoupled"] += m and not run.decoupled
                run.window, run.decoupled = w, m
                live = self._live.get(rid)
                count, _, steps = self._progress(live) if live is not None else (None, None, 0)
                run.mark = (count or 0, steps)  # the new window's rate starts here
            self._m["reconfigured_running"] += n
            self.acted["window_changes"] += n

    def _step_seconds(self, pool: InstancePool) -> Optional[float]:
        """Seconds per engine step in this burst of requests, averaged since each instance's
        clock started (``BurstClock``: a simulated engine advances its step counter a whole plan
        at a time, so short windows mislead); the median over the instances that have stepped."""
        per = []
        for name, inst in pool.instances.items():
            try:
                t = inst.telemetry()
            except Exception:
                continue
            first = self._clock.start(name, t)
            if first is not None and t.steps > first[0] and t.timestamp > first[1]:
                per.append((t.timestamp - first[1]) / (t.steps - first[0]))
        return sorted(per)[len(per) // 2] if per else None

    def _progress(self, live: _Live, tokens: bool = False) -> tuple[Optional[int], Optional[list], int]:
        """(how many tokens the request has so far, those tokens if ``tokens``, its engine steps so
        far) from its original run; the count or the tokens are None where unknown (an instance
        that does not stream tells the count from its last reading, the tokens only from a
        reading with them). The tokens are copied only when asked: the rates need the counts."""
        run = live.original
        if run is None:
            return None, None, 0
        rid = live.request.request_id
        if run.tokens or live.deltas:
            return len(run.tokens), (list(run.tokens) if tokens else None), live.deltas
        got = run.instance.progress(rid)
        if got is None:
            return None, None, 0
        if not tokens:
            return got[0], None, got[1]
        partial = getattr(run.instance, "partial", None)
        seen = partial(rid) if partial is not None else None
        return got[0], (None if seen is None or len(seen) != got[0] else list(seen)), got[1]

    def _decide(self, pool: InstancePool):
        """Algorithm 3 over the requests in flight; returns the copies to start."""
        o = self.options
        freed = [n for n, c in pool.inflight.items() if c == 0]
        if not freed:
            return []
        lad = self.ladder()
        # the candidates, best first at a lone request (the tail), the step's selection leading
        ranked = [n for n, _ in lad.rank(1, self._history, self._usable(lad))]
        methods = ([self._method] if self._method else []) + [n for n in ranked if n != self._method]
        if not methods:
            return []
        rates, running = {}, {}
        for rid, live in self._live.items():
            if live.request.sampling.temperature > 0 and live.request.sampling.keyed_seed is None:
                if not self._warned_sampled:
                    self._warned_sampled = True
                    logger.warning("specactor: Best-of-N is refused for unkeyed sampled requests (temperature > 0): "
                                   "lossless copies need position-keyed sampling, which these engines do not offer; "
                                   "they decode once")
                self._m["bon_refused_sampled"] += 1
                continue
            progress = self._progress(live)
            got = self._rate(live, methods[0], progress)
            if got is None:
                continue
            rates[rid] = got[0]
            running[rid] = {(r.method, r.instance.name) for r in live.runs}
        if not rates:
            return []
        busy = [n for n in pool.instances if n not in freed]
        workers_of = {m: [] for m in methods}
        # a busy instance drafts with the step's method, or where the step decodes plainly with the
        # method its requests carry for the tail (their windows open as the batch drains)
        running_method = self._method or self._tail_method
        for n in busy:
            m = self._worker_method.get(n, running_method)
            if m in workers_of:
                workers_of[m].append(n)
        b_max = o.b_max or 8
        given, plan = assign_best_of_n(rates, methods, freed, workers_of, dict(pool.inflight), b_max, running)
        self._worker_method.update(given)
        # Algorithm 2 on a coupled engine: a below-average request's copy drafts with the best
        # coupled window for its own rate at b = 1 (the ladder's table); the others with the batch's
        out = []
        mean = sum(rates.values()) / len(rates)
        for rid, method, name in plan:
            p = rates[rid]
            window = self._window(method, p if p < mean else None, 1)
            self._m["reconfigured"] += p < mean
            _, tokens, steps = self._progress(self._live[rid], tokens=True)  # where known without a reading
            out.append((self._live[rid], method, pool.instances[name], tokens, steps, window))
        return out

    def _copy_request(self, request: GenRequest, prefix: list, method: str, window: int) -> Optional[GenRequest]:
        left = request.sampling.max_tokens - len(prefix)
        if left <= 0 or (prefix and is_whole(request)):  # a copy continues the request's prefix
            return None
        req = dataclasses.replace(request, prompt_ids=list(request.prompt_ids) + list(prefix),
                                  sampling=request.sampling.with_max_tokens(left))
        return self._with_plan(req, method, window)

    async def rollout(self, requests, pool: InstancePool) -> list[Completion]:
        if self._engine_drafts is None:
            self.engine_spec()
        if self._engine_drafts and requests:
            self._step_batch = -(-len(requests) // len(pool.instances))
            self.select(self._step_batch)
            self._selected = True
            if self._method is not None:
                self._plan_for(len(requests), len(pool.instances) * self.options.verify_gpus)
        before = self._drafting(pool)
        try:
            return await super().rollout(requests, pool)
        finally:
            await self.close()
            self._measured(before, self._drafting(pool))

    @staticmethod
    def _drafting(pool: InstancePool) -> tuple[int, int, int]:
        """(accepted draft tokens, verification steps with a draft, drafted tokens) over the
        instances."""
        acc = drafts = tokens = 0
        for inst in pool.instances.values():
            try:
                t = inst.telemetry()
            except Exception:
                continue
            acc += t.accepted_tokens
            drafts += t.drafts
            tokens += t.draft_tokens
        return acc, drafts, tokens

    def _measured(self, before, after) -> None:
        """The rollout's acceptance becomes the selected method's history for the next
        selection: the per-token rate ``p`` whose expected accepted tokens per drafting step,
        ``p + p^2 + ... + p^w`` at the mean window ``w`` (drafted tokens per drafting step), is
        the measured ``A / drafts`` (exact for one window; at ``w = 1``, ``A / drafts``)."""
        a, d, t = (x - y for x, y in zip(after, before))
        if self._method is not None and d > 0 and t > 0:
            self._history[self._method] = acceptance_from_tokens(1.0 + a / d, t / d)
            self._m["measured_acceptance"] = self._history[self._method]

    def metrics(self) -> dict[str, float]:
        out = {"decoupled_engine": 0.0, **{k: float(v) for k, v in self._m.items()}}
        if self._engine_drafts is not None:
            out["engine_drafter"] = float(self._engine_drafts)
        if self._engine_gain is not None:
            out["engine_drafter_gain"] = self._engine_gain
        return out

    async def close(self) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._loop_task = None
