"""RhymeRL: HistoSpec's AIMD window and batch cut-off, HistoPipe's ranking,
alternation, migration thresholds and two-tier allocation, on constructed cases."""

import itertools
import math

from collections import Counter

import numpy as np
import pytest

from verl_ext.pipe.rhyme.histopipe import (
    migration_beta,
    migration_threshold,
    plan_allocation,
    rank_boundaries,
    rank_groups,
    rank_correlation,
    ranking_group,
    should_migrate,
    worker_order,
    workers_needed,
)
from verl_ext.spec import SCOPE_HISTORY, DraftIndex
from verl_ext.spec.aimd import AimdWindows
from verl_ext.spec.cutoff import MIN_DRAFTED, BatchCutoff
from verl_ext.spec.options import SpecOptions


# -- HistoSpec --------------------------------------------------------------------------------------
def test_aimd_transitions():
    w = AimdWindows(start=2, step=2, max_window=32)
    assert w.get("r") == 2
    assert [w.observe("r", d, d) for d in (2, 4, 6)] == [4, 6, 8]  # additive increase
    assert w.observe("r", 8, 7) == 2  # any rejection: back to the start
    for _ in range(40):
        w.observe("r", w.get("r"), w.get("r"))
    assert w.get("r") == 32  # capped
    assert w.observe("r", 0, 0) == 32  # no draft: unchanged
    assert w.observe("r", 5, 5) == 32  # a shorter draft (tree ran out) fully accepted still counts
    w.drop("r")
    assert w.get("r") == 2 and w.get("other") == 2
    with pytest.raises(ValueError):
        AimdWindows(start=0)
    with pytest.raises(ValueError):
        SpecOptions(k=4, aimd=True, aimd_start=8)
    assert SpecOptions(k=1).k == 1  # the window start is not checked without AIMD windows


def test_native_replay_applies_the_same_aimd_rule():
    """``DraftIndex.replay(aimd_start=)`` (the simulator's replay) follows ``AimdWindows``."""
    rng = np.random.default_rng(0)
    hist = rng.integers(100, 120, 300).astype(np.int32)
    resp = hist.copy()
    resp[[40, 90, 91, 200]] = 7  # divergences from the history: rejections
    prompt = np.array([1, 2, 3], np.int32)
    row = np.concatenate([prompt, resp])
    idx = DraftIndex(32, 0, 32)
    idx.add_history("p", hist, 1.0)
    idx.start_request("r", prompt, history="p", scopes=SCOPE_HISTORY)
    (emitted, drafted), = idx.replay(["r"], [row], [3], [len(row)], 32, scopes=SCOPE_HISTORY,
                                     min_match=3, max_match=7, min_prob=0.0, aimd_start=2, aimd_step=2)
    w = AimdWindows(2, 2, 32)
    for e, d in zip(emitted.tolist(), drafted.tolist()):
        assert d <= w.get("r")
        w.observe("r", d, e - 1)
    assert drafted.max() > 8 and (drafted[1:] == 2).any()  # it grew, and it was reset
    assert emitted.sum() == len(resp)


def test_batch_cutoff_table_and_runtime():
    from verl_ext.perf.cost import load_cost_model

    cost = load_cost_model("h100-7b")
    table = cost.spec_batch_cutoffs(draft=2, contexts=(256, 4096))
    for c in (256, 4096):
        rows = [(a, b) for cc, a, b in table if cc == c]
        assert [b for _, b in rows] == sorted(b for _, b in rows)  # better acceptance: larger batches pay
        assert rows[-1][1] <= cost.max_num_seqs
    short = dict(((a, b) for c, a, b in table if c == 256))
    long = dict(((a, b) for c, a, b in table if c == 4096))
    assert all(long[a] >= short[a] for a in short) and long != short  # memory-bound steps: drafting pays longer
    a, most = 0.15, long[0.15]  # the cut-off is exact: one more request and drafting stops paying
    b = np.array([most, most + 1], dtype=float)
    plain, spec = cost.step_time(b, b * 4096, 0, 0), cost.step_time(b, b * 4096, 0, 2 * b)
    gain = (1 + a * 2) * plain / spec
    assert gain[0] >= 1 - 1e-9 and (most == cost.max_num_seqs or gain[1] < 1)
    cut = BatchCutoff([(0, 0.1, 4), (0, 0.5, 16), (1000, 0.1, 40), (1000, 0.5, 160)])
    assert cut.allows(1000)  # nothing measured yet: draft, to measure
    cut.observe(drafted=100, accepted=30)
    assert cut.rate == pytest.approx(0.3)
    assert cut.allows(4, context=500) and not cut.allows(5, context=500) and cut.off_steps == 1
    assert cut.allows(40, context=1000) and not cut.allows(41, context=5000)
    for _ in range(200):
        cut.observe(100, 90)
    assert cut.max_batch(context=10) == 16 and cut.max_batch(context=2000) == 160
    assert BatchCutoff([(0, 0.2, 8)]).max_batch(rate=0.1) == 0  # below the table: never draft
    with pytest.raises(ValueError):
        SpecOptions(batch_cutoffs=[(0, 1.5, 3)])
    with pytest.raises(ValueError, match="triples"):
        SpecOptions(batch_cutoffs=[(0.5, 3)])


def test_batch_cutoff_probes_out_of_a_bad_start():
    """A low first measurement (below the table: cut-off 0) must not switch drafting off for good:
    every ``probe_every`` steps off, one step drafts and re-measures. All-zero tables never probe."""
    cut = BatchCutoff([(0, 0.1, 4), (0, 0.5, 16)], probe_every=8)
    cut.observe(drafted=4, accepted=0)  # two requests' first 2-token drafts: not a measurement yet
    assert cut.rate == 0 and cut.max_batch() is None and cut.allows(100)
    cut.observe(drafted=12, accepted=0)
    assert cut.max_batch() == 0
    assert [cut.allows(1) for _ in range(9)] == [False] * 8 + [True]
    assert cut.off_steps == 8 and cut.probes == 1 and cut.steps_to_probe() == 8
    for _ in range(100):  # what the probes measure
        cut.observe(10, 9)
    assert cut.allows(16) and not cut.allows(17)
    never = BatchCutoff([(0, 0.5, 0), (0, 0.9, 0)])
    never.observe(10, 10)
    assert not any(never.allows(1) for _ in range(500)) and never.probes == 0
    with pytest.raises(ValueError, match="probe_every"):
        BatchCutoff([(0, 0.5, 4)], probe_every=-1)


@pytest.mark.parametrize("probe", [True, False])
def test_simulated_cutoff_probes_like_the_engine(probe):
    """The simulator replays the engine's probe: an instance whose first drafts measured 0%
    acceptance drafts again (its responses repeat their history exactly), and only with probes."""
    from verl_ext.sim.drafting import make_drafter
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.workload import build_requests, select_epoch
    from verl_ext.sim.source import TraceSource
    from test_sim import _cost, _run

    tr = repeating_trace(groups=4, samples=2, length=400, seed=1)
    _, rows, history = select_epoch(tr, 1)
    src = TraceSource(tr, rows)
    spec = SpecOptions(scopes="history", k=8, min_match=1, max_match=7, min_prob=0.0, aimd=True,
                       batch_cutoffs=[(0, 0.05, 64)])
    inst = SimInstance("sim-0", _cost(), src, make_drafter(spec, src, "auto", history))
    inst._cutoff.observe(drafted=16, accepted=0)  # a bad start
    if not probe:
        inst._cutoff.probe_every = 0
    arm = _run("baseline", [inst], build_requests(tr, rows, 2000))
    assert arm.metrics["output_tokens"] == int(tr.response_lengths()[rows].sum())
    if probe:
        assert inst._cutoff.probes >= 1 and arm.metrics["draft_tokens"] > 0 and arm.metrics["tokens_per_step"] > 1.5
    else:
        assert arm.metrics["draft_tokens"] == 0 and inst._cutoff.off_steps > 0


def test_group_time_counts_histospec_and_its_cutoff():
    """tau(l, dp) with HistoSpec's measured rate: fewer, dearer steps; plain decoding for a batch
    above the cut-off."""
    from verl_ext.pipe.rhyme.histopipe import group_time
    from test_sim import _cost

    cost = _cost()
    plain = group_time(cost, 64, 1000, 2, 100)  # 32 requests per instance, one wave
    fast = group_time(cost, 64, 1000, 2, 100, tokens_per_step=3.0, draft_per_step=4.0)
    steps = 1000 / 3.0
    assert fast == pytest.approx(steps * cost.step_time(32, 32 * 600, 0, 32 * 4.0)) and fast < plain
    assert group_time(cost, 64, 1000, 2, 100, 3.0, 4.0, spec_batch=lambda ctx: 16) == pytest.approx(plain)
    assert group_time(cost, 64, 1000, 2, 100, 3.0, 4.0, spec_batch=lambda ctx: 32) == pytest.approx(fast)


# -- HistoPipe --------------------------------------------------------------------------------------
def test_ranking_and_alternation():
    lengths = {f"p{i}": float(L) for i, L in enumerate([50, 10, 40, 30, 20, 60, 80, 70])}
    b = rank_boundaries(lengths.values(), 4)
    groups = [sorted((u for u in lengths if ranking_group(lengths[u], b) == g), key=lengths.get) for g in range(4)]
    assert groups == [["p1", "p4"], ["p3", "p2"], ["p0", "p5"], ["p7", "p6"]]
    ranked = rank_groups(lengths, 4)
    assert [sorted((u for u in lengths if ranked[u] == g), key=lengths.get) for g in range(4)] == groups
    # ties (responses cut off at one budget) split by prompt, in groups of equal size
    assert rank_groups({"b": 32.0, "a": 32.0, "c": 32.0, "d": 20.0, "e": 32.0}, 2) == {"d": 0, "a": 0, "b": 0, "c": 1, "e": 1}
    with pytest.raises(ValueError):
        rank_groups(lengths, 0)
    assert ranking_group(1e9, b) == 3 and ranking_group(0, b) == 0
    assert worker_order(1, 4) == [0, 1, 2, 3] and worker_order(2, 4) == [3, 2, 1, 0]
    assert worker_order(3, 4) == [0, 1, 2, 3]


def test_migration_thresholds():
    assert migration_beta(None) == 1.1 and migration_beta(0.9) == 1.1 and migration_beta(1.35) == 1.35
    beta = 1.2
    # group of 40 rollouts, longest historical response 1000 tokens: threshold 1200
    assert migration_threshold(1000, beta) == 1201
    assert should_migrate(1201, 1000, beta, running_in_group=4, group_size=40)
    assert not should_migrate(1200, 1000, beta, running_in_group=4, group_size=40)  # not long enough
    assert not should_migrate(5000, 1000, beta, running_in_group=5, group_size=40)  # not among the last 10%
    assert should_migrate(5000, 1000, beta, running_in_group=1, group_size=5)  # the last one always counts
    assert not should_migrate(5000, None, beta, running_in_group=1, group_size=5)  # no history


def _tau(lens_scale):
    # a long group needs more time; more workers help with diminishing returns
    return lambda length, k: length * lens_scale / k + 0.05 * length * math.log1p(k)


def _brute_force(lens, wks, tau, t0, min_wks, max_wks):
    best = (math.inf, None)
    for plan in itertools.product(range(min_wks, max_wks + 1), repeat=len(lens)):
        if sum(plan) > wks:
            continue
        d = max([0.0] + [(tau(lens[i], plan[i]) - t0) / i for i in range(1, len(lens))])
        if tau(lens[0], plan[0]) > t0 * (1 + 1e-12):
            continue
        best = min(best, (d, plan))
    return best


@pytest.mark.parametrize("lens,wks", [([10, 20, 40, 80], 12), ([5, 5, 30], 7), ([1, 2, 4, 8, 16], 16), ([3, 100], 5)])
def test_two_tier_matches_brute_force(lens, wks):
    tau = _tau(10.0)
    n = len(lens)
    max_wks = wks - (n - 1)
    plan, d, t0 = plan_allocation(lens, wks, tau, precision=1e-6)
    d_opt, _ = _brute_force(lens, wks, tau, t0, 1, max_wks)
    assert sum(plan) == wks and min(plan) >= 1
    assert d == pytest.approx(d_opt, abs=1e-5)
    assert t0 == pytest.approx(tau(lens[0], wks // n))  # the shortest group: at most an equal share
    assert plan[0] <= wks // n
    for i in range(n):  # the plan meets the linear targets
        assert tau(lens[i], plan[i]) <= t0 + i * d + 1e-6
    assert plan[-1] >= plan[0]  # long groups get more workers


def test_two_tier_respects_training_time_and_bad_input():
    tau = _tau(1.0)
    plan, d, t0 = plan_allocation([10, 20, 40], 9, tau, t_train=500.0, precision=1e-6)
    assert t0 == 500.0 and sum(plan) == 9
    _, plan_min = workers_needed(d, [10, 20, 40], tau, t0, 1, 7)
    assert plan_min and sum(plan_min) <= 9
    assert plan_allocation([7], 4, tau)[0] == [4]
    with pytest.raises(ValueError, match="ascending"):
        plan_allocation([5, 1], 4, tau)
    with pytest.raises(ValueError, match="at least"):
        plan_allocation([1, 2, 3], 2, tau)


def test_set_histories_replaces_each_given_prompts_tree():
    from _util import ProposerBatch, make_proposer

    from verl_ext.pipe.rhyme.delivery import set_histories_items

    p = make_proposer(scopes="history", k=4, min_match=2, min_prob=0.0)
    old, new = list(range(100, 140)), list(range(300, 340))
    assert p.rpc("set_histories", [("q", [old], [1.0]), ("r", [old], [1.0])]) == 2
    assert p.rpc("await_histories") == 2
    packed = np.asarray(new, dtype=np.int32).tobytes()  # the compact payload (set_histories_items)
    assert set_histories_items({"q": ([np.asarray(new)], [1.0])}) == [("q", [packed], [1.0])]
    # arrays that view a history worker's bytes (HistoryClient.serve) go out as those bytes, no
    # copy; a view of part of them, or another dtype, is copied
    view = np.frombuffer(packed, dtype=np.int32)
    (_, [same], _), = set_histories_items({"q": ([view], [1.0])})
    assert same is packed
    (_, [part, wide], _), = set_histories_items({"q": ([view[1:], view.astype(np.int64)], [1.0, 1.0])})
    assert part == packed[4:] and part is not packed and wide == packed
    assert p.rpc("set_histories", [("q", [packed], [1.0])], ["r"]) == 1  # q replaced, r dropped
    assert p.rpc("await_histories") == 1  # built on the drafter's build thread, now installed
    assert p.rpc("stats")["histories"] == 1
    b = ProposerBatch(p)
    b.add("a", [1] + old[:3], "g", history="q")
    b.add("b", [1] + new[:3], "h", history="q")
    d = b.step()
    assert not d.get("a") and d["b"] == new[3:7]


def test_suffix_proposer_aimd_window_and_cutoff():
    """The engine-side proposer (driven like vLLM's runner) drafts from history within each
    request's AIMD window, learns acceptance from what the engine emitted, and stops drafting for
    a batch above the cut-off."""
    from _util import ProposerBatch, make_proposer

    hist = list(range(100, 200))
    p = make_proposer(scopes="history", k=16, min_match=3, max_match=7, min_prob=0.0, aimd=True,
                      batch_cutoffs=[(0, 0.0, 1), (0, 0.5, 64)])
    assert p.rpc("add_history", "q", [hist], [1.0]) == 1
    b = ProposerBatch(p)
    b.add("a", [1, 2] + hist[:3], "g", history="q")
    d = b.step()
    assert d["a"] == hist[3:5]  # window 2
    d = b.step({"a": hist[3:6]}, emitted_counts=True)  # both accepted (+ bonus): window 4
    assert d["a"] == hist[6:10]
    d = b.step({"a": hist[6:11]}, emitted_counts=True)  # all 4 accepted: window 6
    assert d["a"] == hist[11:17]
    d = b.step({"a": hist[11:13] + [7]}, emitted_counts=True)  # rejected after 2: back to 2
    assert len(d["a"]) <= 2
    assert p.cutoff.rate is not None and 0.5 < p.cutoff.rate < 1.0
    # a second request joins; with a low measured rate (resting on enough drafted tokens: 12 so
    # far, short of MIN_DRAFTED, bind nothing) the batch of 2 is above the cut-off (1)
    assert p.cutoff.drafted == 12 and p.cutoff.max_batch(rate=None) is None
    p.cutoff.rate, p.cutoff.drafted = 0.1, MIN_DRAFTED
    b.add("c", [3] + hist[:3], "g", history="q")
    d = b.step({"a": [8]}, emitted_counts=True)
    assert d == {"a": [], "c": []} and p.cutoff.off_steps == 1
    b.finish("c")
    d = b.step({"a": [9]}, emitted_counts=True)  # alone again: below the cut-off, drafting resumes
    assert p.cutoff.off_steps == 1


# -- the `rhyme` strategy in the simulator ----------------------------------------------------------
def _two_epoch_trace(groups=8, samples=4, outlier=("p0", 1, 900), ranked=True):
    """Epoch 0 and 1 of ``groups`` prompts whose lengths rank the same in both epochs (prompt g
    answers in ~(g + 1) * 20 tokens); in epoch 1 one response is an outlier. ``ranked=False``:
    every response length is drawn from one distribution (no prompt predicts anything)."""
    from verl_ext.trace.format import Trace

    rng = np.random.default_rng(0)
    rows = []
    for e in (0, 1):
        for g in range(groups):
            for j in range(samples):
                n = (g + 1) * 20 + int(rng.integers(0, 5)) if ranked else int(rng.integers(20, 400))
                if e == 1 and (f"p{g}", j) == outlier[:2]:
                    n = outlier[2]
                rows.append(dict(epoch=e, step=e, prompt_uid=f"p{g}", sample_index=j, prompt_ids=[1, 2, 3, g],
                                 response_ids=rng.integers(0, 50, n).tolist(), reward=1.0, finish_reason="stop"))
    return Trace.from_rows(rows)


def repeating_trace(groups: int, samples: int, length: int, seed: int = 0):
    """Two epochs in which every response repeats its previous-epoch response exactly (what
    history drafting finds best)."""
    from verl_ext.trace.format import Trace

    rng = np.random.default_rng(seed)
    texts = {(g, j): rng.integers(0, 50, length).tolist() for g in range(groups) for j in range(samples)}
    return Trace.from_rows([dict(epoch=e, step=e, prompt_uid=f"p{g}", sample_index=j, prompt_ids=[1, 2, g],
                                 response_ids=texts[(g, j)], reward=1.0, finish_reason="stop")
                            for e in (0, 1) for (g, j) in texts])


def _sim_rhyme(tr, epoch, options=None, instances=4):
    from verl_ext.sim.runner import build_requests, run_arm, select_epoch
    from verl_ext.pipe import make_strategy
    from test_sim import _cost

    e, rows, history = select_epoch(tr, epoch)
    reqs = build_requests(tr, rows, 2000)
    strategy = make_strategy("rhyme", {"histospec": False, "histopipe": True, **(options or {})})
    arm = run_arm("rhyme", strategy, None, tr, rows, history, _cost(), instances, "auto", reqs)
    return strategy, arm, reqs


def test_rhyme_first_epoch_dispatches_like_baseline():
    tr = _two_epoch_trace()
    strategy, arm, reqs = _sim_rhyme(tr, 0)
    m = strategy.metrics()
    assert m["histopipe_active"] == 0 and m["migrations"] == 0 and m["unknown_prompts"] == 8
    assert sum(r["output_tokens"] for r in arm.records) == int(tr.response_lengths()[tr.epoch == 0].sum())


def test_rhyme_checks_an_outlier_as_soon_as_it_passes_the_length_condition():
    """The first chunk ends one token past beta x the ranking group's longest historical response,
    where section 6.3's length condition first holds: the outlier moves at its first check, not
    ``recheck_tokens`` (1,024 by default, more than it has left) later."""
    from verl_ext.pipe.rhyme.histopipe import migration_threshold

    tr = _two_epoch_trace()
    strategy, arm, _ = _sim_rhyme(tr, 1, {"ranking_groups": 4, "two_tier": False})
    m = strategy.metrics()
    assert m["migration_checks"] == 1 and m["migrations"] == 1
    moved = [rec for rec in arm.records if rec["request_id"] == "p0-s1"]
    top = max(len(tr.response(i)) for i in np.flatnonzero((tr.epoch == 0) & np.isin(tr.prompt_uid, ["p0", "p1"])))
    assert moved[0]["output_tokens"] == migration_threshold(top, m["beta"]) > m["beta"] * top
    assert sum(rec["output_tokens"] for rec in moved) == 900


def test_prompts_cut_off_at_the_same_budget_split_into_equal_ranking_groups():
    """Every last-epoch response reached a 32-token budget (a run resumed with a longer one), so
    the prompts' historical lengths tie: HistoPipe still splits them into equal ranking groups,
    one instance each. Before, every tied prompt fell in the last ranking group, and one instance
    ran all the requests while the other idled."""
    from verl_ext.trace.format import Trace

    rng = np.random.default_rng(0)
    rows = [dict(epoch=e, step=e, prompt_uid=f"p{g}", sample_index=j, prompt_ids=[1, 2, 3, g],
                 response_ids=rng.integers(0, 50, 32 if e == 0 else (g + 1) * 20).tolist(), reward=1.0,
                 finish_reason="length" if e == 0 else "stop")
            for e in (0, 1) for g in range(8) for j in range(4)]
    strategy, arm, _ = _sim_rhyme(Trace.from_rows(rows), 1, {"ranking_groups": 2, "two_tier": False}, instances=2)
    m = strategy.metrics()
    assert m["histopipe_active"] == 1 and [m["rank0_instances"], m["rank1_instances"]] == [1, 1]
    first = {}
    for rec in arm.records:
        first.setdefault(rec["request_id"], rec["instance"])
    assert sorted(Counter(first.values()).values()) == [16, 16]


def test_rhyme_blocks_alternation_and_outlier_migration():
    tr = _two_epoch_trace()
    strategy, arm, reqs = _sim_rhyme(tr, 1, {"ranking_groups": 4, "two_tier": False, "recheck_tokens": 50})
    m = strategy.metrics()
    assert m["histopipe_active"] == 1 and m["ranking_groups"] == 4
    assert [m[f"rank{g}_instances"] for g in range(4)] == [1, 1, 1, 1]
    # step 2 (even): descending, so the shortest ranking group (p0, p1) takes the last instance
    first = {}
    for rec in arm.records:
        first.setdefault(rec["request_id"], rec["instance"])
    assert {first[f"p{g}-s{j}"] for g in (0, 1) for j in range(4)} == {"sim-3"}
    assert {first[f"p{g}-s{j}"] for g in (6, 7) for j in range(4)} == {"sim-0"}
    # the outlier (900 tokens where its ranking group's longest was ~44) moved once, when it was
    # the last of its group still running, and lost no token
    assert m["migrations"] == 1
    moved = [rec for rec in arm.records if rec["request_id"] == "p0-s1"]
    assert len({rec["instance"] for rec in moved}) == 2
    i = int(np.flatnonzero((tr.epoch == 1) & (tr.prompt_uid == "p0") & (tr.sample_index == 1))[0])
    assert sum(rec["output_tokens"] for rec in moved) == len(tr.response(i)) == 900
    assert sum(r["output_tokens"] for r in arm.records) == int(tr.response_lengths()[tr.epoch == 1].sum())
    # odd step: ascending
    strategy.begin_step(3)
    import asyncio

    from verl_ext.pipe.pool import InstancePool
    from verl_ext.sim.instance import SimInstance

    from test_sim import _cost

    pool = InstancePool([SimInstance(f"sim-{k}", _cost(), None, None) for k in range(4)])
    plan = asyncio.run(strategy._make_plan(reqs, pool))
    assert [b[0].name for b in plan.blocks] == ["sim-0", "sim-1", "sim-2", "sim-3"]


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: ranks (0, 1.5, 1.5, 3) vs (0, 1, 2, 3)
    assert rank_correlation([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert rank_correlation([1, 2], [2, 1]) is None and rank_correlation([3, 3, 3], [1, 2, 3]) is None
    with pytest.raises(ValueError, match="paired"):
        rank_correlation([1, 2, 3], [1, 2])


def test_rhyme_tracks_rank_accuracy_and_falls_back_where_ranks_predict_nothing():
    """Stable ranks: HistoPipe plans (split-half evidence first, then the step's measured
    accuracy). Ranks that predict nothing: it sits the step out, and the rollout is complete."""
    import asyncio

    from verl_ext.pipe.pool import InstancePool
    from verl_ext.sim.instance import SimInstance

    from test_sim import _cost

    tr = _two_epoch_trace(groups=16, outlier=("none", 0, 0))
    strategy, arm, reqs = _sim_rhyme(tr, 1, {"ranking_groups": 4})
    m = strategy.metrics()
    assert m["histopipe_active"] == 1 and m["histopipe_fallbacks"] == 0
    assert m["rank_corr_observed"] == 0 and m["rank_corr"] > 0.9  # split-half within epoch 0
    strategy.begin_step(3)  # the next plan reads how epoch 1's lengths followed the prediction
    pool = InstancePool([SimInstance(f"sim-{k}", _cost(), None, None) for k in range(4)])
    assert asyncio.run(strategy._make_plan(reqs, pool)) is not None
    assert strategy.metrics()["rank_corr_observed"] == 1 and strategy.metrics()["rank_corr"] > 0.9

    noisy = _two_epoch_trace(groups=16, outlier=("none", 0, 0), ranked=False)
    strategy, arm, reqs = _sim_rhyme(noisy, 1, {"ranking_groups": 4})
    m = strategy.metrics()
    assert m["histopipe_active"] == 0 and m["histopipe_fallbacks"] == 1 and m["rank_corr"] < 0.2
    assert sum(r["output_tokens"] for r in arm.records) == int(noisy.response_lengths()[noisy.epoch == 1].sum())
    # measured accuracy is as poor: it stays out; with the check off, HistoPipe plans anyway
    strategy.begin_step(3)
    assert asyncio.run(strategy._make_plan(reqs, pool)) is None
    assert strategy.metrics()["rank_corr_observed"] == 1 and strategy.metrics()["histopipe_fallbacks"] == 2
    strategy, _, _ = _sim_rhyme(noisy, 1, {"ranking_groups": 4, "min_rank_corr": -1.0})
    assert strategy.metrics()["histopipe_active"] == 1


def test_rhyme_two_tier_gives_long_groups_more_instances():
    tr = _two_epoch_trace(groups=8, outlier=("none", 0, 0))
    strategy, arm, _ = _sim_rhyme(tr, 1, {"ranking_groups": 2}, instances=6)
    m = strategy.metrics()
    assert m["rank0_instances"] + m["rank1_instances"] == 6
    assert m["rank1_instances"] > m["rank0_instances"]


def test_rhyme_bad_options_are_clear():
    from verl_ext.pipe import make_strategy
    from verl_ext.pipe.strategy import StrategyConfigError

    with pytest.raises(StrategyConfigError, match="alpha"):
        make_strategy("rhyme", {"alpha": 0})
    with pytest.raises(StrategyConfigError, match="unknown option"):
        make_strategy("rhyme", {"beta": 2})
    with pytest.raises(StrategyConfigError, match="profile"):
        make_strategy("rhyme", {"profile": "/nonexistent.json"})
    with pytest.raises(StrategyConfigError, match="min_rank_corr"):
        make_strategy("rhyme", {"min_rank_corr": 2})


def test_rhyme_serves_each_block_its_prompts_histories():
    """A step's plan loads, with one drafter RPC per engine, the history of the prompts of the
    engine's ranking group (and only those) into drafting engines; a failing engine costs drafts
    only."""
    import asyncio

    from _util import make_proposer
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.history.store import HistoryStore, Trajectory
    from verl_ext.pipe import make_strategy
    from verl_ext.pipe.pool import InstancePool
    from verl_ext.history import LocalHistory

    class Drafting:  # the drafter-RPC side of VLLMInstance, over a real proposer
        drafting = True

        def __init__(self, name, fail=False):
            self.name, self.fail, self.calls, self.sent = name, fail, 0, []
            self.proposer = make_proposer(scopes="history", k=8)

        async def drafter_call(self, op):
            self.calls += 1
            self.sent.append(op)
            if self.fail:
                raise RuntimeError("engine gone")
            return self.proposer.handle(op)

    store = HistoryStore()
    for g in range(4):
        store.ingest([Trajectory(f"p{g}", 1, j, list(range(10 * (g + 1) + j)), 1.0) for j in range(2)])
    insts = [Drafting("e0"), Drafting("e1"), Drafting("e2", fail=True), Drafting("e3")]
    strategy = make_strategy("rhyme", {"histopipe": True, "ranking_groups": 4, "two_tier": False})
    strategy.set_history(LocalHistory(store))
    strategy.begin_step(3)  # odd: ascending, ranking group g on instance e<g>
    reqs = [GenRequest(f"p{g}-s{j}", f"p{g}", [1], SamplingSpec(max_tokens=8), sample_index=j) for g in range(4) for j in range(2)]
    pool = InstancePool(insts)

    def make_plan(strategy, pool):
        async def run():
            plan = await strategy._make_plan(reqs, pool)
            await strategy.close()  # the deliveries the plan started in the background
            return plan
        return asyncio.run(run())

    def held(inst):  # histories the engine's drafter holds once its builds are in
        inst.proposer.rpc("await_histories")
        return inst.proposer.rpc("stats")["histories"]

    plan = make_plan(strategy, pool)
    assert [b[0].name for b in plan.blocks] == ["e0", "e1", "e2", "e3"]
    assert [i.calls for i in insts] == [1, 1, 1, 1]
    for g in (0, 1, 3):
        assert held(insts[g]) == 1, g
    m = strategy.metrics()
    assert m["served_histories"] == 3 and m["history_failures"] == 1
    asyncio.run(strategy._serve_histories([(plan.blocks[g], [f"p{g}"]) for g in range(4)]))  # loaded: no new RPCs
    assert [i.calls for i in insts] == [1, 1, 2, 1]
    # the next step: each engine's trees are replaced by the new history (the store keeps a
    # prompt's last rollout, step 3's), a
    # prompt that moved to another engine is dropped from the old one, and a tree the engine lost
    # (LRU eviction) comes back
    for g in range(4):
        store.ingest([Trajectory(f"p{g}", 3, j, list(range(100, 105 + g + j)), 1.0) for j in range(2)])
    insts[0].proposer.rpc("drop_history", "p0")  # evicted on e0
    strategy.begin_step(4)  # even: descending, ranking group g on instance e<3-g>
    plan = make_plan(strategy, pool)
    assert [b[0].name for b in plan.blocks] == ["e3", "e2", "e1", "e0"]
    assert [i.calls for i in insts] == [2, 2, 3, 2]
    for g in (0, 2, 3):  # (e2, ranking group 1's, fails)
        e = insts[3 - g]
        assert held(e) == 1, g  # its new prompt only; the old one was dropped
        (key, responses, _), = e.sent[-1].items
        responses = sorted(np.frombuffer(r, dtype=np.int32).tolist() for r in responses)  # int32 bytes
        assert key == f"p{g}" and responses == [list(range(100, 105 + g)), list(range(100, 106 + g))]
        assert list(e.sent[-1].drop) == [f"p{3 - g}"]
    m = strategy.metrics()
    assert m["served_histories"] == 6 and m["history_failures"] == 3  # e2: once per attempt
    # HistoSpec without HistoPipe: every drafting engine gets every prompt of the step
    alone = make_strategy("rhyme", {"histopipe": False})
    alone.set_history(LocalHistory(store))
    alone.begin_step(2)
    fresh = [Drafting("f0"), Drafting("f1")]
    assert make_plan(alone, InstancePool(fresh)) is None
    assert [held(f) for f in fresh] == [4, 4]


def test_rhyme_places_a_prompt_that_arrives_after_the_plan_by_its_history():
    """veRL's agent loops submit one request at a time; the step is planned from the requests of
    its first ``PLAN_WINDOW_S``. A prompt whose requests come later (a refill, a later turn) still
    joins its ranking group's block, and that block's drafting engines get its history."""
    import asyncio

    from _util import ScriptedInstance, make_proposer
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.history.store import HistoryStore, Trajectory
    from verl_ext.pipe import make_strategy
    from verl_ext.pipe.pool import InstancePool
    from verl_ext.pipe.rhyme.strategy import PLAN_WINDOW_S
    from verl_ext.history import LocalHistory

    class Drafting(ScriptedInstance):
        drafting = True

        def __init__(self, name):
            super().__init__(name, delay=0.05)
            self.proposer = make_proposer(scopes="history", k=8)

        async def drafter_call(self, op):
            return self.proposer.handle(op)

    store = HistoryStore()
    for g in range(4):  # prompt p<g> answered in ~10 (g + 1) tokens
        store.ingest([Trajectory(f"p{g}", 1, j, list(range(10 * (g + 1) + j)), 1.0) for j in range(2)])
    insts = [Drafting(f"e{i}") for i in range(4)]
    strategy = make_strategy("rhyme", {"histopipe": True, "ranking_groups": 4, "two_tier": False, "migration": False})
    strategy.set_history(LocalHistory(store))
    strategy.begin_step(3)  # odd: ascending, ranking group g on e<g>
    pool = InstancePool(insts)

    def req(g, j):
        return GenRequest(f"p{g}-s{j}", f"p{g}", [1], SamplingSpec(max_tokens=4), sample_index=j)

    async def step():
        first = [asyncio.ensure_future(strategy.submit(req(g, j), pool)) for g in (0, 1, 2) for j in range(2)]
        await asyncio.sleep(PLAN_WINDOW_S * 4)  # planned without p3
        late = [asyncio.ensure_future(strategy.submit(req(3, j), pool)) for j in range(2)]
        out = await asyncio.gather(*first, *late)
        await strategy.close()
        return out

    asyncio.run(step())
    # 3 prompts planned: 3 ranking groups, ascending on blocks [e0, e1], [e2], [e3]; p3 (the
    # longest history) falls in p2's ranking group, whose block is e3
    plan = strategy._plan
    assert [[i.name for i in b] for b in plan.blocks] == [["e0", "e1"], ["e2"], ["e3"]]
    assert plan.group_of("p3") == plan.group_of("p2") == 2
    m = strategy.metrics()
    assert m["late_prompts"] == 1 and m["history_prompts"] == 4
    assert {"p3-s0", "p3-s1"} <= set(insts[3].seen) and not any(r.startswith("p3") for i in insts[:3] for r in i.seen)
    insts[3].proposer.rpc("await_histories")
    assert insts[3].proposer.rpc("stats")["histories"] == 2  # p2's and p3's


def test_one_drafting_policy_caps_engine_steps_and_simulated_plans_alike():
    """``DraftPolicy`` (verl_ext.spec.policy) is the one combination of the engine-side drafting
    rules: an engine step (``step_caps``) and a simulated plan (``plan_caps``) get the same caps
    from per-request windows, the adaptive budget and the cut-off."""
    from verl_ext.spec.options import SpecOptions
    from verl_ext.spec.policy import DraftBatch, DraftPolicy

    opts = SpecOptions(k=8, adaptive=True, knee_tokens=14, sibling_boost=1.0)
    batch = DraftBatch(["a", "b", "c"], 100.0, [None, 2, None], lambda: np.array([0.0, 0.0, 1.0]))
    engine = DraftPolicy(opts).step_caps(batch, np.full(3, 8, dtype=np.int64))
    plan, cut = DraftPolicy(opts).plan_caps(batch)
    assert cut is None and engine.tolist() == plan.tolist()
    assert engine[1] == 2 and engine[2] > engine[0] and engine.sum() <= 14 - 3  # window; boost; budget
    # nothing binds: the plan keeps the replayed schedule (None), the engine its room
    free = DraftBatch(["a"], 100.0, None, None)
    assert DraftPolicy(SpecOptions(k=8)).plan_caps(free) == (None, None)
    assert DraftPolicy(SpecOptions(k=8)).step_caps(free, np.array([5])).tolist() == [5]
    # above the cut-off: no drafts on either path until a probe is due
    cut_opts = SpecOptions(k=8, batch_cutoffs=((0, 0.0, 1), (0, 0.9, 64)))
    policy = DraftPolicy(cut_opts)
    policy.cutoff.cutoff.observe(16, 4)  # rate 0.25: batches above 1 do not draft
    assert policy.step_caps(DraftBatch(["a", "b"], 10.0), np.full(2, 8)).tolist() == [0, 0]
    caps, cut = policy.plan_caps(DraftBatch(["a", "b"], 10.0), commit=False)
    assert caps.tolist() == [0, 0] and cut < 0
