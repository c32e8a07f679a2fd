"""RhymeRL (seed 001): HistoSpec's AIMD window and batch cut-off, HistoPipe's ranking,
alternation, migration thresholds and two-tier allocation, on constructed cases."""

import itertools
import math

import numpy as np
import pytest

from verl_ext.pipe.histopipe import (
    migration_beta,
    migration_threshold,
    plan_allocation,
    rank_boundaries,
    rank_prompts,
    ranking_group,
    should_migrate,
    worker_order,
    workers_needed,
)
from verl_ext.spec import SCOPE_HISTORY, DraftIndex
from verl_ext.spec.aimd import AimdWindows
from verl_ext.spec.cutoff import BatchCutoff
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
    from verl_ext.sim.cost import load_cost_model

    cost = load_cost_model("h100-7b")
    table = cost.spec_batch_cutoffs(draft=2)
    rates = [a for a, _ in table]
    batches = [b for _, b in table]
    assert rates == sorted(rates) and batches == sorted(batches)  # better acceptance: larger batches pay
    assert batches[0] < batches[-1] <= cost.max_num_seqs
    a, most = table[2]  # the cut-off is exact: one more request and drafting stops paying
    b = np.array([most, most + 1], dtype=float)
    plain, spec = cost.step_time(b, b * 4096, 0, 0), cost.step_time(b, b * 4096, 0, 2 * b)
    gain = (1 + a * 2) * plain / spec
    assert gain[0] >= 1 - 1e-9 and (most == cost.max_num_seqs or gain[1] < 1)
    cut = BatchCutoff([(0.1, 4), (0.5, 16)])
    assert cut.allows(1000)  # nothing measured yet: draft, to measure
    cut.observe(drafted=100, accepted=30)
    assert cut.rate == pytest.approx(0.3)
    assert cut.allows(4) and not cut.allows(5) and cut.off_steps == 1
    for _ in range(200):
        cut.observe(100, 90)
    assert cut.max_batch() == 16
    assert BatchCutoff([(0.2, 8)]).max_batch(rate=0.1) == 0  # below the table: never draft
    with pytest.raises(ValueError):
        SpecOptions(batch_cutoffs=[(1.5, 3)])


# -- HistoPipe --------------------------------------------------------------------------------------
def test_ranking_and_alternation():
    lengths = {f"p{i}": float(L) for i, L in enumerate([50, 10, 40, 30, 20, 60, 80, 70])}
    groups = rank_prompts(lengths, 4)
    assert groups == [["p1", "p4"], ["p3", "p2"], ["p0", "p5"], ["p7", "p6"]]
    b = rank_boundaries(lengths.values(), 4)
    assert [ranking_group(lengths[u], b) for g in groups for u in g] == [0, 0, 1, 1, 2, 2, 3, 3]
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
