"""`specactor` (SpecActor): the TGS model against hand-computed values, Algorithm 1
against brute force, Algorithm 2's choice, the draft ladder and initial selection, Algorithm 3
on constructed cases against brute force, and Best-of-N on simulated engines (copies finish
once, lose and duplicate nothing, and leave no engine slot behind; sampled requests refused)."""

import asyncio
import dataclasses
import itertools
import json
import math
import types

import numpy as np
import pytest

from verl_ext.pipe import make_strategy
from verl_ext.pipe.specactor.bon import assign_best_of_n
from verl_ext.pipe.pool import InstancePool
from verl_ext.pipe.strategy import StrategyConfigError
from verl_ext.perf.cost import load_cost_model
from verl_ext.spec.ladder import DraftLadder, DraftMethod, LadderError
from verl_ext.spec.tgs import (COUPLED, DECOUPLED, AffineTime, SpecTimes, plan_decoupled, reconfigure, tau_coupled,
                               tau_decoupled, window_limit)


# -- the TGS model -------------------------------------------------------------------------------
def test_tau_matches_hand_computed_values():
    # w = 2, p = 0.5: P(a=0) = .5 -> 1/2 token, P(a=1) = .25 -> 2/2, P(a=2) = .25 -> 2 tokens
    assert tau_decoupled(0.5, 2) == pytest.approx(0.5 * 0.5 + 0.25 * 1.0 + 0.25 * 2)
    assert tau_decoupled(0.0, 3) == pytest.approx(0.5)  # rejected at once, next window wasted
    assert tau_decoupled(1.0, 4) == pytest.approx(4.0)
    assert tau_coupled(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_coupled(1.0, 3) == pytest.approx(4.0)
    assert tau_coupled(0.3, 0) == 1.0


def _affine(d=(1e-3, 2e-3), v=((2e-3, 10e-3), (3e-3, 10e-3), (4e-3, 11e-3), (5e-3, 11e-3)), gpus=1):
    return SpecTimes.affine(AffineTime(*d), [s for s, _ in v], [i for _, i in v], verify_gpus=4, drafter_gpus=gpus)


def test_tgs_matches_hand_computed_values():
    t = _affine()
    # b = 4, w = 2: D = 4e-3 + 2e-3 = 6e-3, V_2 = 4 * 4e-3 + 11e-3 = 27e-3
    il = max(2 * 6e-3, 27e-3)
    assert t.tgs_decoupled(0.5, 2, 4) == pytest.approx(tau_decoupled(0.5, 2) / il)
    assert t.tgs_coupled(0.5, 2, 4) == pytest.approx(1.75 / (2 * 6e-3 + 27e-3))
    assert t.tgs_plain(4) == pytest.approx(1 / (4 * 2e-3 + 10e-3))
    # two drafter GPUs split the batch: D(ceil(4 / 2))
    assert t.draft_time(4, 2) == pytest.approx(2 * 1e-3 + 2e-3)
    # windows past the last tabulated one reuse it
    assert t.verify(4, 9) == pytest.approx(4 * 5e-3 + 11e-3)


def test_best_window_is_the_argmax():
    t = _affine()
    for p, b, mode in itertools.product((0.1, 0.5, 0.9), (1, 16), (COUPLED, DECOUPLED)):
        w, tgs = t.best_window(p, b, mode, w_max=12)
        fn = t.tgs_coupled if mode == COUPLED else (lambda p, w, b: t.tgs_decoupled(p, w, b))
        vals = [fn(p, x, b) for x in range(1, 13)]
        assert tgs == pytest.approx(max(vals)) and w == 1 + int(np.argmax(vals))


def _brute_force_plan(configs, B, G, p, cap):
    best = None
    for t in configs:
        for g_d in (range(1, t.verify_gpus + 1) if t.drafter_gpus else (0,)):
            if g_d + t.verify_gpus > G:
                continue
            b = math.ceil((g_d + t.verify_gpus) * B / G)
            for w in range(1, cap + 1):
                cur = t.tgs_decoupled(p, w, b, g_d)
                if best is None or cur > best[0]:
                    best = (cur, g_d, t.verify_gpus, w)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_algorithm_1_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    configs = []
    for g_v in (1, 2, 4):
        vs = np.sort(rng.uniform(1e-4, 4e-3, 9))
        vi = np.sort(rng.uniform(5e-3, 2e-2, 9))
        configs.append(SpecTimes.affine(AffineTime(rng.uniform(1e-5, 1e-3), rng.uniform(1e-4, 3e-3)), vs / g_v, vi / math.sqrt(g_v),
                                        verify_gpus=g_v, drafter_gpus=1))
    B, G, p = int(rng.integers(8, 512)), int(rng.choice([8, 16, 32])), float(rng.uniform(0.2, 0.95))
    plan = plan_decoupled(configs, B, G, p, cap=8)
    ref = _brute_force_plan(configs, B, G, p, cap=8)
    # the line-5 pruning never drops the best window: beyond it a round is draft-bound
    assert plan.tgs == pytest.approx(ref[0]) and (plan.g_d, plan.g_v, plan.w) == ref[1:]
    base = max(t.tgs_plain(math.ceil(t.verify_gpus * B / G)) for t in configs)
    assert plan.speedup == pytest.approx(plan.tgs / base)


def test_window_limit_is_where_drafting_catches_up_with_verifying():
    t = _affine(d=(0.0, 3e-3))
    # V_1(1) = 3e-3 + 10e-3 = 13e-3; D(1) = 3e-3 -> ceil(13 / 3) = 5
    assert window_limit(t, 1, 1) == 5
    assert window_limit(_affine(d=(0.0, 0.0), gpus=0), 0, 1, cap=7) == 7  # free drafts: the cap


def test_algorithm_2_reconfigures_only_below_average_requests_and_picks_the_better_mode():
    t = _affine()
    plan = plan_decoupled([t], 64, 8, 0.6, cap=8)
    out = reconfigure(t, plan, {"a": 0.2, "b": 0.9, "c": 0.8}, cap=8)
    assert set(out) == {"a"}  # the mean is 0.63
    r = out["a"]
    w_c, t_c = t.best_window(0.2, 1, COUPLED, w_max=8)
    w_d, t_d = t.best_window(0.2, 1, DECOUPLED, g_d=plan.g_d, w_max=8)
    assert (r.w, r.mode) == ((w_d, DECOUPLED) if t_d > t_c else (w_c, COUPLED))
    assert r.tgs == pytest.approx(max(t_c, t_d))


# -- the ladder ----------------------------------------------------------------------------------
def _ladder():
    v = load_cost_model("h100-32b")
    methods = [DraftMethod("m05", "model", 0.6, drafter="h100-0.5b"), DraftMethod("m15", "model", 0.7, drafter="h100-1.5b"),
               DraftMethod("ngram", "suffix", 0.2, draft_s=(5e-6, 0.0))]
    return DraftLadder.build(v, methods, verify_gpus=4, batches=(1, 128), rates=(0.0, 0.2, 0.4, 0.6, 0.8))


def test_ladder_speedups_follow_the_tgs_model_and_grow_with_acceptance():
    lad = _ladder()
    v = load_cost_model("h100-32b")
    t = lad.methods["m05"].times(v, verify_gpus=4)
    for i, b in enumerate(lad.batches):
        sp = lad.speedup["m05"][i]
        assert all(x <= y + 1e-12 for x, y in zip(sp, sp[1:]))
        j = lad.rates.index(0.6)
        w, tgs = t.best_window(0.6, b, COUPLED)
        assert sp[j] == pytest.approx(tgs / t.tgs_plain(b)) and lad.window["m05"][i][j] == w
    # speculation pays less at a large batch (verification turns compute-bound)
    assert lad.lookup("m05", 0.6, 128) < lad.lookup("m05", 0.6, 1)


def test_initial_selection_ranks_by_speedup_at_historical_acceptance_and_can_pick_plain_decoding():
    lad = _ladder()
    ranked = lad.rank(128)
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
    assert lad.select(128) == ranked[0][0]
    # a method nobody accepts loses to plain decoding
    assert lad.select(128, {"m05": 0.0, "m15": 0.0, "ngram": 0.0}) is None
    # history changes the choice: n-gram drafting with a high measured rate wins at batch 1
    assert lad.select(1, {"m05": 0.1, "m15": 0.1, "ngram": 0.8}) == "ngram"


def test_ladder_round_trips_and_bad_ladders_fail_clearly(tmp_path):
    lad = _ladder()
    p = tmp_path / "ladder.json"
    lad.save(p)
    back = DraftLadder.load(p)
    assert back.speedup == lad.speedup and back.window == lad.window and back.methods == lad.methods
    d = json.loads(p.read_text())
    d["methods"]["m05"]["speedup"] = [[1.0]]
    p.write_text(json.dumps(d))
    with pytest.raises(LadderError, match="tables must be"):
        DraftLadder.load(p)
    p.write_text("{")
    with pytest.raises(LadderError):
        DraftLadder.load(p)
    with pytest.raises(LadderError, match="kind"):
        DraftMethod("x", "eagle", 0.5)


# -- Algorithm 3 ---------------------------------------------------------------------------------
def test_algorithm_3_constructed_case():
    rates = {"r1": 0.1, "r2": 0.5, "r3": 0.3}
    given, plan = assign_best_of_n(rates, ["a", "b", "c"], ["w3", "w4"], {"a": ["w1", "w2"]},
                                   {"w1": 2, "w2": 1, "w3": 0, "w4": 0}, b_max=2,
                                   running={"r1": {("a", "w1")}, "r2": {("a", "w1")}, "r3": {("a", "w2")}})
    # lines 1-3: freed workers go to the methods with the fewest workers (b, then c)
    assert given == {"w3": "b", "w4": "c"}
    # method a has nothing to add (everyone drafts with a); b on w3 takes the two slowest, c on w4 too
    assert plan == [("r1", "b", "w3"), ("r3", "b", "w3"), ("r1", "c", "w4"), ("r3", "c", "w4")]


@pytest.mark.parametrize("seed", range(15))
def test_algorithm_3_respects_budgets_and_serves_lowest_acceptance_first(seed):
    rng = np.random.default_rng(seed)
    n_req, methods = int(rng.integers(1, 8)), ["a", "b", "c"][: int(rng.integers(1, 4))]
    rates = {f"r{i}": float(rng.uniform()) for i in range(n_req)}
    busy = [f"w{i}" for i in range(int(rng.integers(0, 3)))]
    freed = [f"f{i}" for i in range(int(rng.integers(1, 4)))]
    load = {w: int(rng.integers(0, 4)) for w in busy}
    running = {r: {("a", busy[0])} if busy else set() for r in rates}
    b_max = int(rng.integers(1, 4))
    given, plan = assign_best_of_n(rates, methods, freed, {"a": busy}, load, b_max, running)
    assert set(given) == set(freed)
    counts = {m: len([w for w in busy]) if m == "a" else 0 for m in methods}
    for w in freed:  # each freed worker went to a method with the fewest workers at its turn
        m = given[w]
        assert counts[m] == min(counts.values())
        counts[m] += 1
    per_worker = {}
    seen = set()
    for r, m, w in plan:
        assert given.get(w, "a" if w in busy else None) == m
        per_worker[w] = per_worker.get(w, 0) + 1
        assert (r, m) not in seen and (m, w) not in running[r]
        seen.add((r, m))
    for w, n in per_worker.items():
        assert load.get(w, 0) + n <= b_max
    # per (method, worker), the requests taken are the lowest-rate eligible ones, in order
    for m in methods:
        taken = [r for r, mm, _ in plan if mm == m]
        assert taken == sorted(taken, key=lambda r: (rates[r], r))


# -- the strategy on simulated engines -----------------------------------------------------------
def _setup(temperature=0.0, prompts=6, acceptance="suffix=0.7,ngram=0.6", **opts):
    from test_rlhfspec import _sim_setup

    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance

    sims, reqs, want = _sim_setup(prompts=prompts, samples=4, instances=3)
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, temperature=temperature)) for r in reqs]
    st = make_strategy("specactor", {"acceptance": acceptance, **opts})
    spec = st.engine_spec(sims[0].cost)
    drafter = make_drafter(spec, sims[0].source) if spec else None
    sims = [SimInstance(s.name, s.cost, s.source, drafter) for s in sims]
    return st, sims, reqs, want


def test_best_of_n_copies_finish_once_and_lose_nothing_on_simulated_engines():
    from test_rlhfspec import _run, _same_tokens

    st, sims, reqs, want = _setup(min_tokens=4)
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert m["bon_copies"] > 0 and m["decoupled_engine"] == 0
    assert m.get("bon_divergent", 0) == 0
    # aborted copies left no engine slot and no request behind
    for s in sims:
        t = s.telemetry()
        assert t.running == 0 and t.waiting == 0 and not s._by_id
    assert not st._live and st._loop_task is None
    # the copies' work is extra (generated beyond the responses), never missing
    assert sum(s.counters.generated_tokens for s in sims) >= sum(len(w) for w in want.values())


def test_best_of_n_reads_the_progress_of_engines_that_answer_it_only_on_request():
    """Engines that neither stream nor keep tokens at hand (veRL's servers: the drafter's
    ``progress`` op through ``refresh_progress``) get copies too: the strategy takes a reading
    before each round. Without one, no request's tokens so far are known and nothing is copied."""
    from test_rlhfspec import OnRequest, _run, _same_tokens

    st, sims, reqs, want = _setup(min_tokens=4)
    sims = [OnRequest(s.name, s.cost, s.source, s.drafter) for s in sims]
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert all(s.readings > 0 for s in sims)
    # the rounds read counts only; the tokens are read for the requests that get copies
    assert 0 < sum(s.token_readings for s in sims) <= m["bon_copies"] < sum(s.readings for s in sims)
    assert m["bon_copies"] > 0 and m.get("bon_divergent", 0) == 0
    assert all(s.telemetry().running == 0 and not s._by_id for s in sims)


def test_a_plain_steps_requests_get_copies_with_another_method_than_the_one_they_carry():
    """Where the step decodes plainly (no method pays at its batch: inside veRL, ``batch``'s
    default of 64), requests carry the method that pays for a lone request, and their instances
    draft with it once windows open. A freed instance must get another method (Algorithm 3 line
    2 counts the busy ones as that method's workers); given the same one, no request could get
    a copy, as none gets a second copy with a method it runs with."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.pipe.specactor.strategy import _Live, _Run

    st = make_strategy("specactor", {"profile": "cpu-smollm2-avx2", "min_tokens": 4})
    st.engine_spec()
    assert st.select(64) is None and st._tail_method is not None
    busy = types.SimpleNamespace(name="a", progress=lambda rid: (20, 10), partial=lambda rid: list(range(20)))
    freed = types.SimpleNamespace(name="b")
    pool = types.SimpleNamespace(inflight={"a": 2, "b": 0}, instances={"a": busy, "b": freed})
    for i in range(2):
        live = _Live(GenRequest(f"r{i}", "g", [1, 2], SamplingSpec(temperature=0.0, max_tokens=64)))
        live.runs.append(_Run(busy, st._tail_method, [], 0, original=True, window=4))
        st._live[f"r{i}"] = live
    copies = st._decide(pool)
    assert len(copies) == 2
    assert all(inst is freed and method != st._tail_method and prefix == list(range(20))
               for _, method, inst, prefix, _, _ in copies)


def test_a_server_that_does_not_answer_a_progress_reading_is_counted_and_keeps_nothing_stale():
    from verl_ext.rollout.replica_instance import ReplicaInstance

    class Down:  # Ray's __ray_call__ on a dead actor
        def remote(self, *args):
            raise ConnectionError("the actor died")

    server = ReplicaInstance("10.0.0.1:8000", types.SimpleNamespace(__ray_call__=Down()), drafting=True)
    pool = InstancePool([server])
    assert asyncio.run(pool.refresh_progress()) == 0  # nothing running: nothing to read
    server._engine_ids["r0"] = "engine-r0"  # as generate records a running request
    assert asyncio.run(pool.refresh_progress()) == 1
    assert server.progress("r0") is None and server.partial("r0") is None


def test_a_burst_of_requests_is_spread_evenly_over_the_instances():
    """veRL's least-loaded rule over a burst: each dispatched request counts in flight at once
    (``InstancePool.start``), not when its task first runs (then every request of the burst saw
    empty instances and the random tie-break split 24 requests unevenly)."""
    from collections import Counter

    from test_rlhfspec import _run, _same_tokens

    st, sims, reqs, want = _setup(best_of_n=False, reconfigure=False)  # 24 requests, 3 instances
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    assert Counter(r.instance for r in arm.pool.records) == {"sim-0": 8, "sim-1": 8, "sim-2": 8}
    assert all(c == 0 for c in arm.pool.inflight.values())

    async def cancelled_before_it_ran():
        pool = InstancePool(sims)
        task = pool.start(sims[0], reqs[0])
        assert pool.inflight["sim-0"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return pool.inflight["sim-0"]

    assert asyncio.run(cancelled_before_it_ran()) == 0


def test_requests_submitted_one_at_a_time_get_the_selection_of_the_whole_steps_batch():
    """veRL's dispatcher submits a step's requests one at a time and tells the strategy their
    number (``Lifecycle.begin_step(..., requests, instances)``): the initial selection is made at
    the step's per-instance batch, as a driver that passes the whole step to ``rollout`` gets
    it, not at ``options.batch`` (64)."""
    from test_rlhfspec import _run
    from verl_ext.pipe.lifecycle import Lifecycle
    from verl_ext.sim.clock import run_virtual

    whole, sims, reqs, _ = _setup(best_of_n=False)  # 24 requests on 3 instances
    _run(whole, sims, reqs)

    def one_at_a_time(told: bool):
        st, sims, reqs, _ = _setup(best_of_n=False)
        life = Lifecycle(st)

        async def main():
            pool = InstancePool(sims)
            life.begin_step(1, requests=len(reqs) if told else None, instances=len(sims))
            try:
                return await asyncio.gather(*(st.submit(r, pool) for r in reqs))
            finally:
                await st.close()

        done = run_virtual(main())
        assert len(done) == len(reqs)
        return st

    told, untold = one_at_a_time(True), one_at_a_time(False)
    assert whole.metrics()["selection_batch"] == told.metrics()["selection_batch"] == 8
    assert told._method == whole._method
    assert untold.metrics()["selection_batch"] == 64


def test_each_rollout_times_its_rounds_by_its_own_engine_steps():
    """Inside veRL one strategy serves every step, submitted one request at a time, and the
    engines idle between rollouts while the trainer runs; veRL's servers are read only while they
    run requests. Each rollout's rounds are paced by its own engine steps: timed since the first
    rollout, or from the reading the burst starts with (which dates from the last one), the idle
    gap stretched every engine step, and the second rollout had a fraction of the first's rounds."""
    from test_rlhfspec import ReadWhileBusy, watch
    from verl_ext.pipe.lifecycle import Lifecycle
    from verl_ext.sim.clock import run_virtual

    st, sims, reqs, _ = _setup(min_tokens=4)
    sims = [ReadWhileBusy(s.name, s.cost, s.source, s.drafter) for s in sims]
    life = Lifecycle(st)

    async def main():
        asyncio.ensure_future(watch(sims))
        pool = InstancePool(sims)
        rounds = []
        for step in (1, 2):
            life.begin_step(step, requests=len(reqs), instances=len(sims))
            batch = [dataclasses.replace(r, request_id=f"{r.request_id}-s{step}") for r in reqs]
            await asyncio.gather(*(st.submit(r, pool) for r in batch))
            rounds.append(st.metrics()["bon_decisions"])
            await asyncio.sleep(600.0)  # the trainer's turn: the engines idle
        await st.close()
        return rounds

    first, second = run_virtual(main())
    assert first > 2 and second >= first / 2, (first, second)


def test_a_winning_copy_returns_the_whole_response_with_its_prefix():
    from verl_ext.engine.instance import Completion, GenRequest, SamplingSpec
    from verl_ext.pipe.specactor.strategy import _Live, _Run

    st = make_strategy("specactor", {"profile": "h100-7b"})
    req = GenRequest("r", "g", [1, 2], SamplingSpec(temperature=0.0, max_tokens=8, logprobs=True))
    live = _Live(req)
    orig = Completion("r", [5, 6, 7], "abort", logprobs=[-1.0, -2.0, -3.0], num_steps=3)
    copy = Completion("r", [7, 8, 9], "stop", logprobs=[-3.5, -4.0, -5.0], num_steps=2)
    where = types.SimpleNamespace(name="sim-1")
    out = st._splice(live, _Run(where, "ngram", [5, 6], 2), copy, orig)
    assert out.token_ids == [5, 6, 7, 8, 9] and out.logprobs == [-1.0, -2.0, -3.5, -4.0, -5.0]
    assert out.num_steps == 4 and out.finish_reason == "stop"
    assert st.metrics().get("bon_divergent", 0) == 0
    assert out.extra["bon_method"] == "ngram" and out.extra["bon_instance"] == "sim-1"
    st._splice(live, _Run(where, "ngram", [5, 9], 2), copy, orig)
    assert st.metrics()["bon_divergent"] == 1


def test_algorithm_2_reconfigures_running_requests_on_simulated_engines():
    """Every cooldown, requests below the average acceptance get the window for their own rate
    (set_spec_windows on the engines); outputs are unchanged and Best-of-N still works with it."""
    from test_rlhfspec import _run, _same_tokens

    st, sims, reqs, want = _setup(min_tokens=4, best_of_n=False, cooldown=2)
    calls = []
    for s in sims:
        orig = s.set_spec_windows

        async def spy(windows, orig=orig):
            calls.append(dict(windows))
            return await orig(windows)

        s.set_spec_windows = spy
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert m["reconfigured_running"] > 0 and m.get("bon_copies", 0) == 0
    assert sum(len(c) for c in calls) == m["reconfigured_running"]
    lad = st.ladder()
    assert all(0 <= w <= st.options.spec_k for c in calls for w in c.values())
    assert any(w != lad.best_window(st._method, lad.methods[st._method].acceptance, 1) for c in calls for w in c.values())
    off, sims2, reqs2, _ = _setup(min_tokens=4, best_of_n=False, reconfigure=False, cooldown=2)
    _run(off, sims2, reqs2)
    assert off.metrics().get("reconfigured_running", 0) == 0 and off._loop_task is None


def test_simulated_engine_applies_new_windows_to_running_requests():
    """set_spec_windows on a simulated engine caps a running request's drafts from the next step
    on (0: plain decoding), as the vLLM drafter's set_windows op does."""
    import asyncio

    from test_rlhfspec import _sim_setup

    from verl_ext.sim.clock import run_virtual
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance
    from verl_ext.spec import SpecOptions

    sims, reqs, want = _sim_setup(prompts=2, samples=2, instances=1)
    spec = SpecOptions(scopes="request+group", k=8)
    step_s = sims[0].cost.step_time(4, 400)

    def run(windows_after):
        sim = SimInstance("sim-0", sims[0].cost, sims[0].source, make_drafter(spec, sims[0].source, "exact"))

        async def main():
            tasks = [asyncio.ensure_future(sim.generate(r)) for r in reqs]
            n = None
            if windows_after is not None:
                await asyncio.sleep(windows_after * step_s)
                n = await sim.set_spec_windows({**{r.request_id: 0 for r in reqs}, "gone": 3})
            return n, await asyncio.gather(*tasks)

        n, out = run_virtual(main())
        for r, c in zip(reqs, out):
            assert list(c.token_ids) == list(want[r.request_id])
        return n, sim

    _, full = run(None)
    n, late = run(20)
    _, early = run(0.5)
    assert n == len(reqs)  # "gone" is not running there
    full, late, early = full.counters, late.counters, early.counters
    assert full.draft_tokens > late.draft_tokens > early.draft_tokens
    assert early.draft_tokens <= 8 * len(reqs)  # at most the step already planned drafted
    assert early.request_steps > late.request_steps > full.request_steps


def test_proposer_set_windows_reconfigures_a_running_requests_drafts():
    """The vLLM drafter's set_windows op (Algorithm 2 on a real engine) addresses requests by
    verl_ext's request id, across the engine requests it ran as, and caps their next drafts."""
    from _util import ProposerBatch, make_proposer

    p = make_proposer(scopes="request", k=8, min_match=1, max_match=4, min_prob=0.0)
    b = ProposerBatch(p)
    loop = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 4
    b.add("a#1", loop, "g", request_id="a", spec_window=8)
    b.add("b#1", loop, "g", request_id="b")
    first = b.step()
    assert len(first["a#1"]) == 8 and len(first["b#1"]) == 8
    assert p.rpc("set_windows", {"a": 2, "b": 0, "gone": 5}) == 2
    nxt = b.step({"a#1": [1], "b#1": [1]})
    assert len(nxt["a#1"]) == 2 and nxt["b#1"] == []
    b.finish("a#1")
    b.step({"b#1": [2]})
    assert p.rpc("set_windows", {"a": 4}) == 0 and "a" not in p._engine_ids and "a#1" not in p._window
    with pytest.raises(ValueError, match="set_windows needs"):
        p.rpc("set_windows", [("b", 1)])


def test_sampled_requests_never_get_copies():
    from test_rlhfspec import _run, _same_tokens

    st, sims, reqs, want = _setup(temperature=1.0, min_tokens=4)
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert m.get("bon_copies", 0) == 0 and m["bon_refused_sampled"] > 0
    assert sum(s.counters.generated_tokens for s in sims) == sum(len(w) for w in want.values())


def test_plain_decoding_when_no_method_pays_and_clear_config_errors():
    from test_rlhfspec import _run, _same_tokens

    st, sims, reqs, want = _setup(acceptance="suffix=0.0,ngram=0.0")
    assert st.engine_spec(sims[0].cost) is None
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    assert st.metrics()["selected_method"] == -1 and st.metrics().get("bon_copies", 0) == 0
    with pytest.raises(StrategyConfigError, match="acceptance"):
        make_strategy("specactor", {"acceptance": "suffix=2"})
    with pytest.raises(StrategyConfigError, match="ladder"):
        make_strategy("specactor", {"ladder": "/nonexistent/ladder.json"})
    with pytest.raises(StrategyConfigError, match="needs a draft ladder"):
        make_strategy("specactor").engine_spec(None)


def test_profile_ladder_cli_measures_suffix_acceptance_on_a_trace(tmp_path, capsys):
    from pathlib import Path

    from verl_ext.cli import main as cli_main
    from verl_ext.spec import SpecOptions
    from verl_ext.spec.replay import trace_acceptance
    from verl_ext.trace.format import read_trace

    trace_path = Path(__file__).resolve().parents[1] / "data" / "traces" / "smollm2_arith_e2.parquet"
    out = tmp_path / "ladder.json"
    assert cli_main(["fit", "ladder", "cpu-smollm2", "--trace", f"{trace_path}@0", "--k", "8",
                     "--method", "ngram=suffix:request@trace", "--method", "fixed=suffix:request+group@0.5",
                     "--out", str(out)]) == 0
    lad = DraftLadder.load(out)
    trace = read_trace(trace_path)
    ref = trace_acceptance(trace, np.flatnonzero(trace.epoch == 0), SpecOptions(scopes="request", k=8))
    assert 0.0 < ref["acceptance"] < 1.0 and ref["accepted_tokens"] <= ref["draft_tokens"]
    assert lad.methods["ngram"].acceptance == pytest.approx(ref["acceptance"])
    assert lad.methods["fixed"].acceptance == 0.5 and lad.methods["ngram"].draft_s[0] > 0
    assert "initial selection" in capsys.readouterr().out
    assert cli_main(["fit", "ladder", "cpu-smollm2", "--method", "x=suffix:request@trace", "--out", str(out)]) == 2
    assert "needs a trace (--trace" in capsys.readouterr().err


# -- the simulator's synthetic drafting (draft-model methods) --------------------------------------
def _synthetic_run(methods, default="m", window=None, k=6, extra=None, strategy="baseline", opts=None,
                   decoupled=False, instances=2, prompts=4, samples=4):
    from test_rlhfspec import _run, _sim_setup

    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.synthetic import SyntheticDrafter
    from verl_ext.spec import SpecOptions

    sims, reqs, want = _sim_setup(prompts=prompts, samples=samples, instances=instances)
    drafter = SyntheticDrafter(SpecOptions(k=k), methods, default, seed=3, decoupled=decoupled)
    sims = [SimInstance(s.name, s.cost, s.source, drafter) for s in sims]
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, temperature=0.0),
                                extra={**r.extra, **(extra or {}), **({"spec_window": window} if window is not None else {})})
            for r in reqs]
    st = make_strategy(strategy, opts or {})
    if strategy == "specactor":
        st.engine_spec(sims[0].cost)
    arm = _run(st, sims, reqs)
    for r, c in zip(reqs, arm.completions):
        assert list(c.token_ids) == list(want[r.request_id])  # outputs are the target's
    return arm, sims, st


def test_synthetic_drafter_accepts_at_the_methods_rate():
    """A fixed rate p and window w emit tau_coupled(p, w) tokens per step on average; rates 0
    and 1 give one token and w + 1 tokens per step (until a response's end)."""
    from verl_ext.sim.synthetic import SyntheticMethod

    for p in (0.0, 0.5, 0.8):
        arm, sims, _ = _synthetic_run({"m": SyntheticMethod(p, concentration=1e9)}, window=4)
        drafted = sum(s.counters.draft_tokens for s in sims)
        if p == 0.0:
            assert arm.metrics["tokens_per_step"] == 1.0 and drafted > 0
        else:
            assert arm.metrics["tokens_per_step"] == pytest.approx(tau_coupled(p, 4), rel=0.06), p
    arm, _, _ = _synthetic_run({"m": SyntheticMethod(1.0)}, window=3)
    assert arm.metrics["tokens_per_step"] > 3.9  # 4 per step but the last steps of each response


def test_synthetic_rates_are_per_request_and_method_and_draft_models_cost_time():
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticDrafter, SyntheticMethod
    from verl_ext.spec import SpecOptions

    d = SyntheticDrafter(SpecOptions(k=4), {"a": SyntheticMethod(0.6), "b": SyntheticMethod(0.6)}, "a", seed=1)
    rates = [d.rate(f"r{i}", "a") for i in range(200)]
    assert rates == [d.rate(f"r{i}", "a") for i in range(200)]  # the same in every arm
    assert np.mean(rates) == pytest.approx(0.6, abs=0.05) and np.std(rates) > 0.05
    assert np.corrcoef(rates, [d.rate(f"r{i}", "b") for i in range(200)])[0, 1] < 0.3  # methods independent
    free, _, _ = _synthetic_run({"m": SyntheticMethod(0.6)}, window=4)
    paid, _, _ = _synthetic_run({"m": SyntheticMethod(0.6, draft_cost=load_cost_model("h100-1.5b"))}, window=4)
    assert paid.metrics["tokens_per_step"] == free.metrics["tokens_per_step"]  # same draws
    assert paid.metrics["wall_s"] > free.metrics["wall_s"] * 1.05  # the draft model's steps
    with pytest.raises(ValueError, match="default method"):
        SyntheticDrafter(SpecOptions(k=4), {"a": SyntheticMethod(0.6)}, "zz")


def test_decoupled_rounds_overlap_drafting_and_waste_the_window_after_a_rejection():
    """Decoupled: a round takes max(draft, verify) instead of their sum, and each rejection is
    followed by a round over stale drafts that emits one token (the relaxed barrier's waste)."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticMethod

    p, w = 0.7, 4
    m = {"m": SyntheticMethod(p, concentration=1e9, draft_cost=load_cost_model("h100-1.5b"))}
    coupled, _, _ = _synthetic_run(m, window=w)
    dec, sims, _ = _synthetic_run(m, window=w, decoupled=True)
    reject = 1 - p ** w
    want = (tau_coupled(p, w) + reject) / (1 + reject)  # tokens per round, stale rounds included
    assert dec.metrics["tokens_per_step"] == pytest.approx(want, rel=0.06)
    assert sims[0].drafter.stale_rounds > 0
    assert dec.metrics["tokens_per_step"] < coupled.metrics["tokens_per_step"]
    # rounds are cheaper (overlap) though they emit fewer tokens: here the overlap wins
    assert dec.metrics["wall_s"] < coupled.metrics["wall_s"]


def test_a_request_switched_to_coupled_drafts_before_the_verification_and_wastes_no_window():
    """Algorithm 2's per-request mode in decoupled execution (SyntheticDrafter.set_mode): a mixed
    step takes max(V + D_coupled, D_decoupled); only decoupled requests verify stale windows."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticDrafter, SyntheticMethod
    from verl_ext.spec import SpecOptions

    m = {"m": SyntheticMethod(0.0, concentration=1e9, draft_cost=load_cost_model("h100-1.5b"))}  # rejects all
    d = SyntheticDrafter(SpecOptions(k=4), m, "m", seed=1, decoupled=True)
    target = types.SimpleNamespace(prompt_len=3, tokens=list(range(40)))
    for key in ("c", "d"):
        d.start(key, GenRequest(key, "g", [1, 2, 3], SamplingSpec(max_tokens=40)), target)
    d.set_mode("c", False)
    assert not d.is_decoupled("c") and d.is_decoupled("d")
    drafted = np.array([4, 4])
    alone = [d.draft_seconds(["c", "d"], np.array(x), 0.0) for x in ([4, 0], [0, 4])]
    assert d.with_drafting(0.01, ["c", "d"], drafted, 0.0) == pytest.approx(max(0.01 + alone[0], alone[1]))
    emitted, _ = d.step(["c", "d"], [3, 3])  # both rejected: one token each
    emitted, drafted = d.step(["c", "d"], [4, 4])
    assert d.stale_rounds == 1 and list(drafted) == [4, 4]  # only "d" verified its stale window
    coupled = SyntheticDrafter(SpecOptions(k=4), m, "m", seed=1)
    coupled.set_mode("x", False)  # coupled execution: every request is coupled already
    with pytest.raises(ValueError, match="decoupled execution"):
        coupled.set_mode("x", True)


def test_algorithm_2_switches_low_acceptance_requests_to_coupled_in_decoupled_execution(tmp_path):
    """In decoupled execution, below-average requests get the better of the best coupled and
    the best decoupled window at b = 1; with a draft model that rejects most of their drafts,
    coupled wins (no wasted window). Outputs are the target's."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticMethod

    cost = load_cost_model("h100-7b")
    lad = DraftLadder.build(cost, [DraftMethod("m", "model", 0.6, drafter="h100-0.5b")], max_window=8)
    path = tmp_path / "ladder.json"
    lad.save(path)
    methods = {"m": SyntheticMethod(0.6, concentration=2.0)}  # rates spread between requests
    arm, sims, st = _synthetic_run(methods, k=8, strategy="specactor", decoupled=True, instances=2,
                                   opts={"ladder": str(path), "model_methods": True, "spec_k": 8, "min_tokens": 4,
                                         "cooldown": 1, "best_of_n": False, "execution": "decoupled",
                                         "switch_modes": True})
    m = st.metrics()
    assert m["switched_coupled"] > 0 and m["reconfigured_running"] > 0
    _, _, off = _synthetic_run(methods, k=8, strategy="specactor", decoupled=True, instances=2,
                               opts={"ladder": str(path), "model_methods": True, "spec_k": 8, "min_tokens": 4,
                                     "cooldown": 1, "best_of_n": False, "execution": "decoupled"})
    assert off.metrics()["reconfigured_running"] > 0 and off.metrics().get("switched_coupled", 0) == 0
    with pytest.raises(StrategyConfigError, match="switch_modes needs execution=decoupled"):
        make_strategy("specactor", {"switch_modes": True})
    low = min(st._lone_request_plan("m", p)[1] for p in (0.05, 0.1))
    assert low is False  # a low rate runs coupled at b = 1
    assert st._lone_request_plan("m", 0.95)[1] is True  # a high one decoupled


def test_a_copy_that_finishes_first_wins_and_the_original_is_aborted(tmp_path):
    """Best-of-N: the originals draft with a method that accepts nothing for them, the copies with
    one that accepts almost everything; copies started on freed instances finish first, win, and
    their originals are aborted (a copy started after the wait began must still be waited for)."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticMethod

    cost = load_cost_model("h100-7b")
    # the ladder's history says "bad" is the better method; the truth for these requests differs
    lad = DraftLadder.build(cost, [DraftMethod("bad", "model", 0.8, drafter="h100-0.5b"),
                                   DraftMethod("good", "model", 0.5, drafter="h100-0.5b")], max_window=8)
    path = tmp_path / "ladder.json"
    lad.save(path)
    methods = {"bad": SyntheticMethod(0.0), "good": SyntheticMethod(0.95)}
    arm, sims, st = _synthetic_run(methods, default="bad", k=8, strategy="specactor", instances=3,
                                   opts={"ladder": str(path), "model_methods": True, "spec_k": 8, "min_tokens": 4,
                                         "cooldown": 1, "reconfigure": False})
    m = st.metrics()
    assert m["selected_method"] == 0 and m["bon_copies"] > 0 and m["bon_wins"] > 0
    aborted = [r for r in arm.pool.records if r.finish_reason == "abort"]
    assert len(aborted) >= m["bon_wins"]  # each win aborted the original (and any other copy)
    for s in sims:
        assert s.telemetry().running == 0 and not s._by_id


def test_acceptance_from_tokens_inverts_the_tokens_per_step():
    from verl_ext.pipe.specactor.strategy import acceptance_from_tokens

    for w in (1, 3, 8):
        for p in (0.1, 0.5, 0.9):
            assert acceptance_from_tokens(tau_coupled(p, w), w) == pytest.approx(p, abs=1e-6)
            r = 1 - p ** w
            assert acceptance_from_tokens((tau_coupled(p, w) + r) / (1 + r), w, decoupled=True) == pytest.approx(p, abs=1e-6)
    assert acceptance_from_tokens(1.0, 4) == 0.0 and acceptance_from_tokens(9.0, 4) == 1.0
    assert acceptance_from_tokens(2.0, 0) == 0.0
    with pytest.raises(StrategyConfigError, match="execution"):
        make_strategy("specactor", {"execution": "pipelined"})


def test_windows_open_in_the_tail_when_the_step_decodes_plainly(tmp_path):
    """The initial selection finds no method that pays at the step's batch (plain decoding), but
    one pays for a lone request: requests carry it with window 0, and reconfiguration opens their
    windows once their instance's batch has drained."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticMethod

    cost = load_cost_model("h100-7b")
    lad = DraftLadder.build(cost, [DraftMethod("small", "model", 0.5, drafter="h100-0.5b")], max_window=8)
    path = tmp_path / "ladder.json"
    lad.save(path)
    opts = {"ladder": str(path), "model_methods": True, "spec_k": 8, "min_tokens": 4, "cooldown": 1,
            "best_of_n": False}
    st = make_strategy("specactor", opts)
    st.engine_spec(cost)
    step_batch = 256  # 16 x 16 requests on one instance
    assert st.select(step_batch) is None and st._tail_method == "small"
    methods = {"small": SyntheticMethod(0.5, draft_cost=load_cost_model("h100-0.5b"))}
    run = dict(default="small", k=8, strategy="specactor", instances=1, prompts=16, samples=16)
    arm, sims, st = _synthetic_run(methods, opts=opts, **run)
    m = st.metrics()
    assert m["selected_method"] == -1 and m["reconfigured_running"] > 0 and arm.metrics["draft_tokens"] > 0
    off, _, _ = _synthetic_run(methods, opts={**opts, "reconfigure": False}, **run)
    assert off.metrics["draft_tokens"] == 0  # without it the step decodes plainly throughout


def test_specactor_drafts_model_methods_per_request_in_the_simulator(tmp_path):
    """With model_methods, the ladder's draft-model methods are selected and sent per request
    (spec_method); without it, a ladder of model methods leaves real engines decoding plainly."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.sim.synthetic import SyntheticMethod

    cost = load_cost_model("h100-7b")
    lad = DraftLadder.build(cost, [DraftMethod("small", "model", 0.7, drafter="h100-0.5b"),
                                   DraftMethod("big", "model", 0.8, drafter="h100-1.5b")], max_window=8)
    path = tmp_path / "ladder.json"
    lad.save(path)
    methods = {"small": SyntheticMethod(0.7, draft_cost=load_cost_model("h100-0.5b")),
               "big": SyntheticMethod(0.8, draft_cost=load_cost_model("h100-1.5b"))}
    arm, sims, st = _synthetic_run(methods, default="small", k=8, strategy="specactor",
                                   opts={"ladder": str(path), "model_methods": True, "spec_k": 8, "min_tokens": 4})
    assert st.metrics()["selected_method"] >= 0 and arm.metrics["tokens_per_step"] > 1.5
    from verl_ext.engine.instance import GenRequest, SamplingSpec

    planned = st._with_plan(GenRequest("r", "g", [1], SamplingSpec()), "big", 3)
    assert planned.extra == {"spec_window": 3, "spec_method": "big"}  # no suffix scopes for a model
    assert make_strategy("specactor", {"ladder": str(path)}).engine_spec(cost) is None


# -- acceptance estimates ------------------------------------------------------------------------
def test_ladder_prices_a_batch_between_its_tabulated_neighbours():
    """17 requests per worker read as 16 (log2-nearest), not as the next tabulated batch, 64."""
    v = load_cost_model("h100-32b")
    lad = DraftLadder.build(v, [DraftMethod("m05", "model", 0.6, drafter="h100-0.5b")], verify_gpus=4,
                            batches=(1, 16, 64), rates=(0.0, 0.4, 0.8))
    assert lad.best_window("m05", 0.8, 17) == lad.best_window("m05", 0.8, 16)
    assert lad.best_window("m05", 0.8, 50) == lad.best_window("m05", 0.8, 64)
    at16, at17, at64 = (lad.lookup("m05", 0.8, b) for b in (16, 17, 64))
    assert at16 > at64 and at64 < at17 < at16 and at16 - at17 < (at16 - at64) / 10
    assert lad.lookup("m05", 0.8, 32) == pytest.approx((at16 + at64) / 2)  # halfway in log2


class _Progress:
    """An instance whose request has produced ``tokens`` tokens in ``steps`` engine steps."""

    name = "e0"

    def __init__(self):
        self.tokens, self.steps = 0, 0

    def advance(self, steps, tokens_per_step):
        self.steps += steps
        self.tokens += int(round(steps * tokens_per_step))

    def partial(self, rid):
        return [1] * self.tokens

    def progress(self, rid):
        return self.tokens, self.steps


def test_a_requests_rate_is_measured_at_its_current_window():
    """After Algorithm 2 shrinks a run's window from 4 to 1, its rate comes from the tokens per
    step since then: cumulative tokens per step, read at the new window, would say p = 1."""
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.pipe.specactor.strategy import _Live, _Run, acceptance_from_tokens

    st = make_strategy("specactor", {"profile": "h100-7b", "acceptance": "suffix=0.7", "min_tokens": 16})
    inst = _Progress()
    live = _Live(GenRequest("r", "g", [1], SamplingSpec(max_tokens=512)))
    run = _Run(inst, "suffix", [], 0, original=True, window=4)
    live.runs.append(run)
    inst.advance(20, 2.0)  # 2 tokens per step at window 4
    p4, *_ = st._rate(live, None)
    assert p4 == pytest.approx(acceptance_from_tokens(2.0, 4))
    run.rate, run.window, run.mark = p4, 1, (inst.tokens, inst.steps)  # what _reconfigure_running sets
    inst.advance(4, 1.5)
    assert st._rate(live, None)[0] == p4  # too few tokens at the new window yet: the last measured rate
    inst.advance(20, 1.5)  # 1.5 tokens per step at window 1: p = 0.5
    assert st._rate(live, None)[0] == pytest.approx(0.5, abs=0.02)
    run.window, run.mark, run.rate = 0, (inst.tokens, inst.steps), None  # plain decoding: the method's prior
    inst.advance(20, 1.0)
    assert st._rate(live, None)[0] == pytest.approx(0.7)


def test_a_rollouts_measured_acceptance_is_the_per_token_rate():
    """The engines count accepted tokens, drafting steps and drafted tokens; at window 1 the
    per-token rate is accepted / drafted (A / (A + drafts) would read p / (1 + p))."""
    from verl_ext.spec.tgs import tau_coupled

    st = make_strategy("specactor", {"acceptance": "suffix=0.7"})
    st._method = "suffix"
    st._measured((0, 0, 0), (600, 1000, 1000))  # w = 1, p = 0.6
    assert st.metrics()["measured_acceptance"] == pytest.approx(0.6, abs=1e-6)
    accepted = 1000 * (tau_coupled(0.5, 4) - 1)  # w = 4, p = 0.5: 1000 drafting steps
    st._measured((0, 0, 0), (accepted, 1000, 4000))
    assert st.metrics()["measured_acceptance"] == pytest.approx(0.5, abs=1e-6)
