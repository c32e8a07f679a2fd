"""`rlhfspec` (RLHFSpec): the workload-aware draft selection (search, early stop against
exhaustive search and a brute-force reference, F, the step-time cache), the reallocation greedy
against its constraints, and sample migration on simulated engines: nothing lost or duplicated,
a migration racing a finishing request, a full or failing destination."""

import asyncio
import dataclasses
import itertools

import numpy as np
import pytest

from verl_ext.engine.instance import FINISH_ABORT
from verl_ext.pipe import make_strategy
from verl_ext.pipe.rlhfspec.realloc import Move, pick_samples, plan_reallocation, turning_point
from verl_ext.pipe.strategy import StrategyConfigError
from verl_ext.perf.cost import load_cost_model
from verl_ext.spec import SpecOptions
from verl_ext.spec._suffix import select_chains, select_tree
from verl_ext.spec.select import AcceptanceModel, DraftSelector, StepTimePredictor, cumulative_scores, depth_bucket, pav


# -- the search ---------------------------------------------------------------------------------
def _random_chains(rng, rows, width):
    lens = rng.integers(0, width + 1, rows).astype(np.int32)
    cond = rng.uniform(0.2, 1.0, (rows, width)).astype(np.float32)
    return cumulative_scores(cond, lens), lens


def _brute_force(scores, lens, F, t, base):
    """Reference: every n, the n heaviest nodes of all chains (weights never rise along a chain,
    so they form prefixes); the best al(n) / t(n)."""
    w = np.interp(scores, np.linspace(0, 1, len(F)), F)
    nodes = sorted(((w[i, j], i) for i in range(len(lens)) for j in range(lens[i])), key=lambda x: -x[0])
    best, best_n, al = base / t[0], 0, base
    for n, (wi, _) in enumerate(nodes[: len(t) - 1], 1):
        al += wi
        if al / t[n] > best + 1e-12:
            best, best_n = al / t[n], n
    return best_n, best


@pytest.mark.parametrize("seed", range(20))
def test_exhaustive_search_matches_brute_force_and_early_stop_matches_it_on_concave_objectives(seed):
    rng = np.random.default_rng(seed)
    scores, lens = _random_chains(rng, rows=int(rng.integers(1, 40)), width=int(rng.integers(1, 12)))
    F = np.sort(rng.uniform(0, 1, 11)).astype(np.float32)
    n_max = int(lens.sum())
    # a roofline step time: flat to a knee, then linear (what the cost model gives)
    knee = int(rng.integers(0, max(1, n_max)))
    t = 1.0 + 0.05 * np.maximum(0, np.arange(n_max + 1) - knee)
    base = float(len(lens))
    caps, (n, ev, obj, al) = select_chains(scores, lens, F, t, base, 0)
    ref_n, ref_obj = _brute_force(scores, lens, F, t, base)
    assert obj == pytest.approx(ref_obj, rel=1e-5) and n == ref_n
    assert caps.sum() == n and (caps <= lens).all() and ev == n_max
    # Equation 3: once al/t falls it keeps falling here, so stopping early loses nothing
    caps_e, (n_e, ev_e, obj_e, _) = select_chains(scores, lens, F, t, base, 2)
    assert n_e == n and obj_e == pytest.approx(obj) and (caps_e == caps).all()
    assert ev_e <= ev


def test_early_stop_evaluates_fewer_nodes_and_never_beats_exhaustive():
    rng = np.random.default_rng(5)
    scores, lens = _random_chains(rng, rows=64, width=32)
    F = np.linspace(0, 1, 21).astype(np.float32)
    t = 1.0 + 0.02 * np.maximum(0, np.arange(lens.sum() + 1) - 40)
    _, (_, ev_full, obj_full, _) = select_chains(scores, lens, F, t, 64.0, 0)
    _, (_, ev_early, obj_early, _) = select_chains(scores, lens, F, t, 64.0, 4)
    assert ev_early < ev_full / 2
    assert obj_early <= obj_full + 1e-9 and obj_early == pytest.approx(obj_full, rel=1e-3)


def test_tree_search_on_chains_equals_chain_search_and_keeps_trees_connected():
    rng = np.random.default_rng(3)
    scores, lens = _random_chains(rng, rows=10, width=6)
    F = np.linspace(0, 1, 5).astype(np.float32)
    t = 1.0 + 0.1 * np.maximum(0, np.arange(lens.sum() + 1) - 8)
    caps, (n, *_rest) = select_chains(scores, lens, F, t, 10.0, 0)
    parents, flat = [], []
    for i in range(10):
        for j in range(lens[i]):
            parents.append(-1 if j == 0 else len(parents) - 1)
            flat.append(scores[i, j])
    mask, (n_tree, *_rest) = select_tree(np.array(parents, np.int32), np.array(flat, np.float32), F, t, 10.0, 0)
    assert n_tree == n
    per_row = np.split(mask, np.cumsum(lens)[:-1])
    assert [int(m.sum()) for m in per_row] == caps.tolist()
    # a branching tree: a heavy grandchild is only taken after its (lighter) parent
    par = np.array([-1, 0, 1, 0], np.int32)
    sc = np.array([0.9, 0.2, 0.95, 0.5], np.float32)
    flat_t = np.ones(5)
    mask, (k, *_r) = select_tree(par, sc, np.array([0, 1], np.float32), np.array([1.0, 1.0, 1.0, 10.0, 10.0]), 1.0, 0)
    assert k == 2 and mask.tolist() == [True, False, False, True]
    mask, (k, *_r) = select_tree(par, sc, np.array([0, 1], np.float32), flat_t, 1.0, 0)
    assert k == 4 and mask.all()


def test_search_rejects_malformed_input():
    with pytest.raises(ValueError, match="lens"):
        select_chains(np.zeros((2, 3), np.float32), np.array([4, 0], np.int32), np.ones(2, np.float32), np.ones(5), 2.0, 0)
    with pytest.raises(ValueError, match="parent index"):
        select_tree(np.array([-1, 5], np.int32), np.ones(2, np.float32), np.ones(2, np.float32), np.ones(3), 1.0, 0)
    with pytest.raises(ValueError, match="patience"):
        select_chains(np.zeros((1, 1), np.float32), np.array([1], np.int32), np.ones(2, np.float32), np.ones(2), 1.0, -1)


def test_compute_bound_profile_drafts_only_tokens_that_pay_for_their_verification():
    """On the CPU profile a draft token costs a sizeable share of a step: a draft whose acceptance
    is below the break-even w* = B (t(1) / t(0) - 1) is never selected, one above it is."""
    cost = load_cost_model("cpu-smollm2")
    b, ctx = 32, 200
    t0, t1 = cost.step_time(b, b * ctx, 0, 0), cost.step_time(b, b * ctx, 0, 1)
    w_star = b * (t1 / t0 - 1)
    assert 0.1 < w_star < 1.0  # on this CPU, drafts need high acceptance to pay
    scores = np.ones((b, 8), np.float32)
    low = DraftSelector(cost, AcceptanceModel(prior=[0.0, 0.9 * w_star]))
    caps, choice = low.select_lengths(scores, np.full(b, 8), b * ctx)
    assert caps.sum() == 0 and choice.n == 0
    high = DraftSelector(cost, AcceptanceModel(prior=[0.0, min(1.0, 1.5 * w_star)]))
    caps, choice = high.select_lengths(scores, np.full(b, 8), b * ctx)
    assert choice.n > 0
    # on a GPU profile the low-acceptance drafts ride free below the knee
    gpu = DraftSelector(load_cost_model("h100-7b"), AcceptanceModel(prior=[0.0, 0.9 * w_star]))
    caps, choice = gpu.select_lengths(scores, np.full(b, 8), b * ctx)
    assert choice.n > b


def test_acceptance_model_learns_online_and_stays_monotone():
    f = AcceptanceModel()
    assert f(0.5) == pytest.approx(0.5)  # prior F(s) = s
    rng = np.random.default_rng(0)
    s = rng.uniform(0, 1, 20000)
    f.observe(s, rng.uniform(0, 1, len(s)) < 0.2 * s)  # true acceptance 0.2 s
    assert f(0.9) == pytest.approx(0.18, abs=0.03) and f(0.3) == pytest.approx(0.06, abs=0.03)
    assert (np.diff(f.table()) >= 0).all()
    fitted = AcceptanceModel.fit(s, rng.uniform(0, 1, len(s)) < 0.5 * s)
    assert fitted(0.8) == pytest.approx(0.4, abs=0.05)
    opts = SpecOptions(acceptance=tuple(map(tuple, fitted.prior)))
    assert np.allclose(np.array(opts.acceptance), fitted.prior)
    assert np.allclose(AcceptanceModel(prior=opts.acceptance).prior, fitted.prior)
    # per depth: a deep node is judged apart from a shallow one of the same score
    deep = AcceptanceModel()
    deep.observe(np.ones(4000), np.arange(4000) % 10 < 5, 0)  # depth 0: half accepted
    deep.observe(np.ones(4000), np.arange(4000) % 10 < 1, 9)  # depth 9: a tenth
    assert deep(1.0, 0) == pytest.approx(0.5, abs=0.02) and deep(1.0, 9) == pytest.approx(0.1, abs=0.02)
    with pytest.raises(ValueError, match="acceptance"):
        SpecOptions(acceptance=(0.5,))


def test_step_time_cache_hits_within_a_bucket_and_stays_close_to_the_model():
    cost = load_cost_model("h100-7b")
    p = StepTimePredictor(cost)
    c1 = p.curve(64, 100_000, 50)
    c2 = p.curve(64, 101_000, 40)
    assert p.misses == 1 and p.hits == 1 and np.array_equal(c1[:41], c2)
    exact = cost.step_time(64, 100_000, 0, np.arange(51))
    assert np.allclose(c1, exact, rtol=0.03)
    p.curve(64, 100_000, 500)  # longer than cached: re-evaluated
    assert p.misses == 2


def test_selection_expects_the_prefill_that_steps_carry():
    """Drafts that ride free on decode-only steps push a step that also prefills over the
    compute knee: the selector predicts the expected step time over the prefill it has seen."""
    cost = load_cost_model("h100-7b")
    p = StepTimePredictor(cost)
    drafts = np.arange(201)
    c = p.curve(48, 100_000, 200, (0.25, 100))  # a quarter of the steps prefill ~100 tokens
    t0, tp = cost.step_time(48, 100_000, 0, drafts), cost.step_time(48, 100_000, 100, drafts)
    want = t0[0] + 0.75 * (t0 - t0[0]) + 0.25 * (tp - tp[0])  # the drafts' expected cost; not the prefill's own
    assert np.allclose(c, want, rtol=0.03) and c[0] == pytest.approx(t0[0], rel=0.03)
    assert np.array_equal(p.curve(48, 100_000, 200), p.curve(48, 100_000, 200, (0.0, 500)))  # q = 0: none
    sel = DraftSelector(cost, AcceptanceModel(prior=[0.0, 0.06]))  # drafts accepted 6% of the time
    assert sel.prefill_share == 0 and sel.prefill_tokens == 0
    scores = np.ones((48, 8), np.float32)
    free, _ = sel.select_lengths(scores, np.full(48, 8), 48 * 2000)
    for i in range(400):
        sel.note_prefill(120 if i % 4 == 0 else 0)
    assert sel.prefill_share == pytest.approx(0.25, abs=0.03) and sel.prefill_tokens == pytest.approx(120)
    loaded, _ = sel.select_lengths(scores, np.full(48, 8), 48 * 2000)
    assert 0 < loaded.sum() < free.sum()  # fewer drafts once a quarter of the steps prefill
    st = sel.stats()
    assert st["select_prefill_share"] == sel.prefill_share and st["select_prefill_tokens"] == 120


def test_step_prefill_tokens_from_a_scheduler_output():
    from types import SimpleNamespace

    from verl_ext.vllm.proposer import step_prefill_tokens

    sched = SimpleNamespace(num_scheduled_tokens={"new": 300, "dec": 1, "spec": 5, "chunk": 64},
                            scheduled_spec_decode_tokens={"spec": [1, 2, 3, 4]})
    assert step_prefill_tokens(sched) == 299 + 0 + 0 + 63
    assert step_prefill_tokens(SimpleNamespace()) == 0


def test_select_needs_a_profile_and_a_valid_one():
    with pytest.raises(ValueError, match="select_profile"):
        SpecOptions(select=True).draft_selector()
    with pytest.raises(ValueError, match="select_profile"):
        SpecOptions(select=True, select_profile="no-such-preset")
    assert SpecOptions(select=True).draft_selector(load_cost_model("h100-7b")) is not None
    with pytest.raises(StrategyConfigError, match="profile"):
        make_strategy("rlhfspec").engine_spec(None)
    with pytest.raises(StrategyConfigError, match="allocation"):
        make_strategy("rlhfspec", {"allocation": "random"})


# -- reallocation -------------------------------------------------------------------------------
def test_pairing_follows_the_paper_example_and_its_constraints():
    # Figure 5: (24 + 1) samples; with a threshold of 19, 5 samples move: (19 + 6)
    assert plan_reallocation({"ins1": 24, "ins2": 1}, 19) == [Move("ins1", "ins2", 5)]
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        counts = {f"i{j}": int(c) for j, c in enumerate(rng.integers(0, 40, n))}
        thr = int(rng.integers(1, 40))
        moves = plan_reallocation(counts, thr)
        involved = [m.source for m in moves] + [m.dest for m in moves]
        assert len(involved) == len(set(involved))  # at most one migration per instance
        for m in moves:
            assert counts[m.source] - m.samples >= thr and counts[m.dest] + m.samples <= thr
            assert m.samples == min(counts[m.source] - thr, thr - counts[m.dest]) > 0
        # largest difference first: sources by descending, destinations by ascending count
        assert [counts[m.source] for m in moves] == sorted((counts[m.source] for m in moves), reverse=True)
        assert [counts[m.dest] for m in moves] == sorted(counts[m.dest] for m in moves)
        # the greedy pairs as many as it can: min(#sources, #destinations) pairs
        srcs = sum(c > thr for c in counts.values())
        dsts = sum(c < thr for c in counts.values())
        assert len(moves) == min(srcs, dsts)


def test_pairing_maximises_what_destinations_gain_on_small_cases():
    """Equation 6 by brute force over every one-to-one pairing, on small instances."""
    rng = np.random.default_rng(2)
    for _ in range(100):
        counts = {f"i{j}": int(c) for j, c in enumerate(rng.integers(0, 12, int(rng.integers(2, 6))))}
        thr = int(rng.integers(1, 12))
        srcs = [k for k, c in counts.items() if c > thr]
        dsts = [k for k, c in counts.items() if c < thr]
        best = 0
        for perm in itertools.permutations(dsts, min(len(srcs), len(dsts))):
            for src_perm in itertools.permutations(srcs, len(perm)):
                best = max(best, sum(min(counts[s] - thr, thr - counts[d]) for s, d in zip(src_perm, perm)))
        got = sum(m.samples for m in plan_reallocation(counts, thr))
        assert got == best


def test_turning_point_is_where_the_marginal_gain_drops():
    cost = load_cost_model("h100-7b")
    thr = turning_point(cost, 1.0, 0.0, 512)
    s = np.arange(1, cost.max_num_seqs + 1)
    tput = s / cost.step_time(s, s * 512)
    gain = np.diff(np.concatenate([[0.0], tput]))
    assert gain[thr] < 0.5 * gain[0] <= gain[thr - 1]
    # drafting makes a sample heavier: the instance saturates with fewer samples
    assert turning_point(cost, 2.0, 3.0, 512) < thr
    assert pick_samples([("a", 100, 0.1), ("b", 50, 2.0), ("c", 60, 0.0)], 2) == ["c", "a"]


# -- migration on simulated engines ---------------------------------------------------------------
def _sim_setup(prompts=4, samples=4, instances=2, max_num_seqs=None, instance_cls=None):
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.runner import SimConfig, build_requests, load_workload, select_epoch
    from verl_ext.sim.source import TraceSource

    cfg = SimConfig(synth=dict(prompts=prompts, samples=samples, mean_len=256, max_len=1024), similarity="published")
    trace = load_workload(cfg)
    _, rows, _ = select_epoch(trace)
    cost = load_cost_model("h100-7b")
    if max_num_seqs:
        cost = dataclasses.replace(cost, max_num_seqs=max_num_seqs)
    source = TraceSource(trace, rows)
    cls = instance_cls or [SimInstance] * instances
    sims = [c(f"sim-{i}", cost, source, None) for i, c in enumerate(cls)]
    reqs = build_requests(trace, rows, int(trace.response_lengths()[rows].max()))
    want = {r.request_id: source.target(r).tokens for r in reqs}
    return sims, reqs, want


def _on_request_cls():
    from verl_ext.sim.instance import SimInstance

    class OnRequest(SimInstance):
        """A simulated engine that answers ``progress`` and ``partial`` from its last
        ``refresh_progress`` reading only (``partial`` from one with ``tokens``), as veRL's
        servers do (through the drafter)."""

        def __init__(self, *args):
            super().__init__(*args)
            self.read: dict = {}
            self.readings = self.token_readings = 0

        def progress(self, rid):
            got = self.read.get(rid)
            return None if got is None else got[:2]

        def partial(self, rid):
            got = self.read.get(rid)
            return None if got is None or got[2] is None else list(got[2])

        async def refresh_progress(self, request_ids=None, tokens=False):
            self.readings += 1
            self.token_readings += tokens
            ids = self._by_id if request_ids is None else [r for r in request_ids if r in self._by_id]
            for rid in ids:
                n, steps = SimInstance.progress(self, rid)
                self.read[rid] = (n, steps, list(SimInstance.partial(self, rid)) if tokens else None)
            return bool(ids)

    return OnRequest


OnRequest = _on_request_cls()


def _read_while_busy_cls():
    from verl_ext.sim.instance import SimInstance

    class ReadWhileBusy(SimInstance):
        """A simulated engine whose telemetry is the last reading of ``watch`` (every 0.5 s while
        it runs requests), as veRL's servers are read (``StrategyDispatcher._watch_load``): the
        reading a burst of requests starts with dates from the end of the last one."""

        snap = None

        def telemetry(self):
            if self.snap is None:
                self.snap = SimInstance.telemetry(self)
            return self.snap

    return ReadWhileBusy


ReadWhileBusy = _read_while_busy_cls()


async def watch(instances, every_s=0.5):
    """Read each busy ``ReadWhileBusy`` every ``every_s`` (cancel to stop)."""
    from verl_ext.sim.instance import SimInstance

    while True:
        await asyncio.sleep(every_s)
        for inst in instances:
            if inst.running or inst.waiting:
                inst.snap = SimInstance.telemetry(inst)


def _run(strategy, sims, reqs, on_finish=None):
    from verl_ext.compare.run import run_strategy
    from verl_ext.sim.clock import run_virtual

    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(strategy, sims, reqs, lambda r, t: 0.0, clock=loop.time, sample_telemetry=False,
                                  on_finish=on_finish)

    return run_virtual(main())


def _same_tokens(arm, reqs, want):
    assert len(arm.completions) == len(reqs)
    for r, c in zip(reqs, arm.completions):
        assert c.finish_reason != FINISH_ABORT
        assert list(c.token_ids) == list(want[r.request_id]), r.request_id


def test_migrations_lose_and_duplicate_nothing():
    # three groups of 4 on two instances: 8 + 4 samples, threshold 6: 2 move at the first decision
    sims, reqs, want = _sim_setup(prompts=3, samples=4)
    st = make_strategy("rlhfspec", {"speculation": False, "allocation": "grouped", "threshold": 6, "cooldown": 1})
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert m["migrations"] > 0 and m["decisions"] > 0
    assert m.get("migrations_failed", 0) == 0
    # every generated token was generated once: the instances emitted exactly the responses
    assert sum(s.counters.generated_tokens for s in sims) == sum(len(w) for w in want.values())
    assert not st._live and st._loop_task is None


def test_samples_to_move_are_picked_by_progress_read_from_engines_that_do_not_stream():
    """Samples are picked by what they have generated (``pick_samples``: the cheapest to move).
    Engines that answer progress only on request (veRL's servers) get a reading before each
    decision, so they move the same samples as engines that report it at once."""
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance

    moved = []
    for cls in (SimInstance, OnRequest):
        sims, reqs, want = _sim_setup(prompts=3, samples=4)
        # drafting: samples of a group accept differently, so their progress differs
        st = make_strategy("rlhfspec", {"allocation": "grouped", "threshold": 6, "cooldown": 1})
        drafter = make_drafter(st.engine_spec(sims[0].cost), sims[0].source)
        sims = [cls(s.name, s.cost, s.source, drafter) for s in sims]
        arm = _run(st, sims, reqs)
        _same_tokens(arm, reqs, want)
        where: dict = {}
        for rec in arm.pool.records:
            where.setdefault(rec.request_id, set()).add(rec.instance)
        moved.append(sorted(r for r, s in where.items() if len(s) > 1))
    assert moved[0] and moved[1] == moved[0]
    assert all(s.readings > 0 for s in sims)


def test_engines_that_do_not_stream_are_read_only_when_a_move_is_planned():
    """A progress reading of veRL's servers is an RPC per server: a decision that plans no move
    (here 4 + 4 samples below a turning point of 6) reads nothing."""
    sims, reqs, want = _sim_setup(prompts=2, samples=4, instance_cls=[OnRequest, OnRequest])
    st = make_strategy("rlhfspec", {"speculation": False, "allocation": "grouped", "threshold": 6, "cooldown": 1})
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    assert st.metrics()["decisions"] > 0 and st.metrics().get("migrations", 0) == 0
    assert [s.readings for s in sims] == [0, 0]


def test_each_rollout_paces_its_decisions_by_its_own_engine_steps():
    """Inside veRL one strategy serves every step, and the engines idle between rollouts while
    the trainer runs; veRL's servers are read only while they run requests. The next rollout's
    decisions are paced by its own engine steps: before, the first rate it measured spanned the
    idle gap (one engine step seemed to last the whole gap), the loop slept past the rollout,
    and the second step moved nothing."""
    import dataclasses

    from verl_ext.compare.run import run_strategy
    from verl_ext.sim.clock import run_virtual

    sims, reqs, want = _sim_setup(prompts=3, samples=4, instance_cls=[ReadWhileBusy, ReadWhileBusy])
    st = make_strategy("rlhfspec", {"speculation": False, "allocation": "grouped", "threshold": 6, "cooldown": 1})

    async def main():
        loop = asyncio.get_running_loop()
        asyncio.ensure_future(watch(sims))
        moved = []
        for step in (1, 2):
            st.begin_step(step)
            batch = [dataclasses.replace(r, request_id=f"{r.request_id}-s{step}") for r in reqs]
            await run_strategy(st, sims, batch, lambda r, t: 0.0, clock=loop.time, sample_telemetry=False)
            moved.append(st.metrics().get("migrations", 0))
            await asyncio.sleep(600.0)  # the trainer's turn: the engines idle
        return moved

    assert run_virtual(main()) == [2, 2]


def test_a_migration_racing_a_finishing_request_finishes_it_once():
    sims, reqs, want = _sim_setup(prompts=2, samples=2)
    st = make_strategy("rlhfspec", {"speculation": False, "reallocation": False})
    raced = []

    def on_finish():
        # the reallocator's abort is on its way (moving set) when a request finishes: the one
        # still counted live whose engine no longer holds it
        if raced:
            return
        for rid, s in st._live.items():
            if s.instance.progress(rid) is None:
                s.moving = next(i for i in sims if i is not s.instance)
                raced.append(rid)
                return

    arm = _run(st, sims, reqs, on_finish=on_finish)
    assert raced
    _same_tokens(arm, reqs, want)
    assert st.metrics()["migration_races"] == 1
    assert sum(s.counters.generated_tokens for s in sims) == sum(len(w) for w in want.values())


def test_a_full_destination_leaves_the_sample_on_its_source():
    from verl_ext.pipe.pool import InstancePool
    from verl_ext.sim.clock import run_virtual

    sims, reqs, want = _sim_setup(prompts=2, samples=4, max_num_seqs=4)
    src, dest = sims
    st = make_strategy("rlhfspec", {"speculation": False, "reallocation": False})
    mine, foreign = reqs[0], reqs[4:8]  # the other group fills the destination (another tenant)

    async def main():
        pool = InstancePool(sims, clock=asyncio.get_running_loop().time)
        others = [asyncio.ensure_future(dest.generate(r)) for r in foreign]
        task = asyncio.ensure_future(st.submit(mine, pool))
        await asyncio.sleep(0.05)
        s = st._live[mine.request_id]
        assert s.instance is src and dest.telemetry().running == 4
        await st._migrate(s, dest)
        assert s.moving is None  # not aborted
        return await task, await asyncio.gather(*others)

    c, _ = run_virtual(main())
    assert list(c.token_ids) == list(want[mine.request_id]) and c.finish_reason != FINISH_ABORT
    m = st.metrics()
    assert m["migrations_skipped"] == 1 and "migrations" not in m
    assert src.counters.generated_tokens == len(want[mine.request_id])  # it never restarted


def test_a_destination_that_fails_after_the_abort_resumes_the_sample_on_its_source():
    from verl_ext.sim.instance import SimInstance

    class Gone(SimInstance):
        """An instance that takes no new work (its process died): ``generate`` raises."""

        async def generate(self, request, on_tokens=None):
            if request.extra.get("chunk"):
                raise RuntimeError("instance is gone")
            return await super().generate(request, on_tokens)

    sims, reqs, want = _sim_setup(prompts=3, samples=4, instance_cls=[SimInstance, Gone])
    st = make_strategy("rlhfspec", {"speculation": False, "allocation": "grouped", "threshold": 6, "cooldown": 1})
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    m = st.metrics()
    assert m.get("migrations_failed", 0) > 0


def test_selection_on_simulated_engines_keeps_outputs_and_drafts():
    """Selection runs per step in the simulator (exact replay) and only changes speed."""
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance

    sims, reqs, want = _sim_setup(prompts=4, samples=4)
    st = make_strategy("rlhfspec", {"reallocation": False})
    spec = st.engine_spec(sims[0].cost)
    assert spec.select and spec.min_prob == 0.0
    drafter = make_drafter(spec, sims[0].source)
    assert drafter.mode == "exact"
    sims = [SimInstance(s.name, s.cost, s.source, drafter) for s in sims]
    arm = _run(st, sims, reqs)
    _same_tokens(arm, reqs, want)
    stats = sims[0].selector.stats()
    assert stats["select_steps"] > 0 and 0 < stats["select_selected_tokens"] <= stats["select_candidate_tokens"]
    assert sum(s.counters.accepted_tokens for s in sims) > 0
    with pytest.raises(ValueError, match="exact"):
        make_drafter(spec, sims[0].source, mode="lockstep")


def test_pav_is_the_weighted_isotonic_fit_row_by_row():
    """The native pool-adjacent-violators (F's refit after every step) against the closed form
    of the weighted least-squares non-decreasing fit, x_i = max_{j<=i} min_{k>=i} mean_w(y[j..k])."""
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 21):
        y = rng.random((7, n))
        w = rng.random((7, n)) * 10 + 1e-3
        got = pav(y, w)
        for r in range(7):
            mean = lambda j, k: float(np.dot(y[r, j:k + 1], w[r, j:k + 1]) / w[r, j:k + 1].sum())
            want = [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]
            np.testing.assert_allclose(got[r], want, rtol=1e-12)
        assert (np.diff(got, axis=1) >= 0).all()
        np.testing.assert_array_equal(pav(y[0], w[0]), got[0])  # 1-D: one row
    assert pav([3.0, 1.0, 2.0], 1.0).tolist() == [2.0, 2.0, 2.0]


def test_the_native_step_observation_table_and_scores_are_the_numpy_rule_bit_for_bit():
    """What the selector does every step, native (observe_chains, acceptance_table,
    cumulative_scores), against the rule written in numpy: the counts of each drafted node at
    its depth bucket and nearest score point (ties to even), the window's scaling, the shrunk
    and isotonic table, and the running float32 products, equal to the last bit over many
    random steps, with the window reached."""
    rng = np.random.default_rng(1)
    native = AcceptanceModel(points=21, window=64.0)
    ref = AcceptanceModel(points=21, window=64.0)

    def ref_table(m):
        est = (m.accepted + m.prior_weight * m.prior) / np.maximum(m.seen + m.prior_weight, 1e-12)
        return np.clip(pav(est, m.seen + 1.0), 0.0, 1.0).astype(np.float32)

    for step in range(300):
        b, w = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        probs = rng.random((b, w)).astype(np.float32)
        lens = rng.integers(0, w + 1, b)
        p = np.where(np.arange(w)[None, :] < lens[:, None], probs, 0.0)
        scores = cumulative_scores(probs, lens)
        np.testing.assert_array_equal(scores, np.cumprod(p, axis=1, dtype=np.float32))
        scores[rng.random((b, w)) < 0.05] = rng.choice([0.125, 0.375, 0.625, 0.875])  # x 20: exactly half-way
        drafted = np.minimum(lens, rng.integers(0, w + 1, b))
        accepted = rng.integers(0, w + 1, b)
        native.observe_chains(scores, drafted, accepted)
        j = np.broadcast_to(np.arange(w)[None, :], scores.shape)
        mask = j < drafted[:, None]
        ref.observe(scores[mask], (j < accepted[:, None])[mask], j[mask])
        np.testing.assert_array_equal(native.seen, ref.seen)
        np.testing.assert_array_equal(native.accepted, ref.accepted)
        np.testing.assert_array_equal(native.table(), ref_table(ref))
    assert native.seen.max() == 64.0  # the window scaled some points


def test_acceptance_counts_land_in_their_depth_bucket_and_score_point():
    assert depth_bucket([0, 3, 4, 7, 8, 15, 16, 40]).tolist() == [0, 3, 4, 4, 5, 5, 6, 6]
    m = AcceptanceModel(points=11)
    m.observe([0.0, 0.52, 0.52, 1.0], [1, 0, 1, 1], [0, 5, 5, 20])
    assert m.seen[0, 0] == 1 and m.seen[4, 5] == 2 and m.seen[6, 10] == 1 and m.seen.sum() == 4
    assert m.accepted[4, 5] == 1 and m.accepted.sum() == 3
