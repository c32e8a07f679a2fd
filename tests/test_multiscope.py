"""``multiscope``: Seer's rollout with global drafts and history length priors (issue 51)."""

import asyncio
import logging

import pytest

from test_seer import _buffer, _chunk
from test_sim import _cost, _requests, _trace

from verl_ext.history.store import HistoryStore, LocalHistory, Trajectory
from verl_ext.pipe import StrategyConfigError, make_strategy
from verl_ext.pipe.pool import InstancePool
from verl_ext.sim.clock import run_virtual
from verl_ext.sim.instance import SimInstance
from verl_ext.sim.source import TraceSource


def test_a_history_prior_is_l_g_until_the_group_finishes():
    buf, add, _ = _buffer(probes=False)
    a = [add(f"a{i}", "a") for i in range(2)]
    b = [add(f"b{i}", "b") for i in range(2)]
    c = [add(f"c{i}", "c") for i in range(2)]
    assert buf.set_prior("a", 30) and buf.set_prior("b", 80) and not buf.set_prior("zz", 5)
    assert buf.set_prior("c", 500)  # longer than max_tokens (another step's budget): capped
    assert [buf.estimate(r) for r in (a[0], b[0], c[0])] == [30, 80, 100]
    assert buf.pick() is c[0] and buf.pick() is c[1] and buf.pick() is b[0]  # longest prior first
    _chunk(buf, b[0], 90)  # b runs past its prior: the longest generated counts
    assert buf.estimate(b[1]) == 90
    _chunk(buf, buf.pick(), 40, done=True)  # the first pick is b[1], then b[0]; b[1] finishes at 40
    assert buf.estimate(b[0]) == 90  # finished: Seer's estimate (max of finished and generated)
    # without a prior: max_tokens, as before
    buf2, add2, _ = _buffer(probes=False)
    assert buf2.estimate(add2("x0", "x")) == 100


def _history_of(tr, step=1, longest=None):
    """A history store holding ``tr``'s responses as step ``step - 1``'s (``longest``: per prompt,
    the longest response to record instead, a longer history than this step will have)."""
    store = HistoryStore()
    store.ingest(Trajectory(str(tr.prompt_uid[i]), step - 1, int(tr.sample_index[i]),
                            tr.response(i).tolist() if longest is None else [1] * longest[str(tr.prompt_uid[i])])
                 for i in range(len(tr)))
    store.close_step(step - 1)
    return LocalHistory(store)


def _roll(strategy, tr, history=None, step=1):
    src = TraceSource(tr)
    insts = [SimInstance(f"sim-{i}", _cost(), src) for i in range(2)]

    async def main():
        pool = InstancePool(insts, clock=asyncio.get_running_loop().time)
        if history is not None:
            strategy.set_history(history)
        strategy.begin_step(step)
        done = await asyncio.gather(*(strategy.submit(r, pool) for r in _requests(tr, max_tokens=400)))
        await strategy.close()
        return done

    return run_virtual(main())


def test_history_lengths_seed_the_estimates_and_the_rollout_is_exact():
    tr = _trace(groups=4, samples=3, seed=5)
    longest = {f"p{g}": 50 * (g + 1) for g in range(4)}  # p3 has the longest history
    strat = make_strategy("multiscope", {"chunk_size": 32, "speculative": False, "probes": False})
    done = _roll(strat, tr, _history_of(tr, longest=longest))
    assert [list(c.token_ids) for c in done] == [tr.response(i).tolist() for i in range(len(tr))]
    m = strat.metrics()
    assert m["prior_groups"] == 4 and m["history_failures"] == 0 and strat.acted["history_length_priors"] == 4


def test_without_history_or_with_a_failing_one_the_rollout_goes_on(caplog):
    tr = _trace(groups=3, samples=3, seed=6)
    strat = make_strategy("multiscope", {"chunk_size": 32, "speculative": False})
    done = _roll(strat, tr)  # no provider: Seer's estimates
    assert [list(c.token_ids) for c in done] == [tr.response(i).tolist() for i in range(len(tr))]
    assert strat.metrics()["history_lookups"] == 0

    class Broken:
        async def lengths(self, uids, step=None):
            raise ConnectionError("history worker gone")

    strat = make_strategy("multiscope", {"chunk_size": 32, "speculative": False})
    with caplog.at_level(logging.WARNING):
        done = _roll(strat, tr, Broken())
    assert [list(c.token_ids) for c in done] == [tr.response(i).tolist() for i in range(len(tr))]
    assert strat.metrics()["history_failures"] >= 1 and strat.metrics()["prior_groups"] == 0
    assert "no history lengths (ConnectionError: history worker gone)" in caplog.text


def test_engine_spec_adds_the_history_and_global_scopes_and_the_ablation_switches_drop_them():
    spec = make_strategy("multiscope").engine_spec()
    assert spec.scopes == "request+group+history+global" and spec.global_tokens == 1 << 20
    seer = make_strategy("seer").engine_spec()
    assert make_strategy("multiscope", {"global_drafts": False, "history_drafts": False}).engine_spec() == seer
    no_global = make_strategy("multiscope", {"global_drafts": False, "global_tokens": 4096}).engine_spec()
    assert no_global.scopes == "request+group+history" and no_global.global_tokens == seer.global_tokens
    small = make_strategy("multiscope", {"global_tokens": 4096, "group_drafts": False, "history_drafts": False}).engine_spec()
    assert small.scopes == "request+global" and small.global_tokens == 4096
    assert make_strategy("multiscope", {"speculative": False}).engine_spec() is None
    # a first epoch (no history yet) drafts from the other scopes; a history-only spec from none
    assert spec.without("history").scopes == "request+group+global"
    assert make_strategy("rhyme").engine_spec().without("history") is None


@pytest.mark.parametrize("options, match", [({"global_tokens": 0}, "global_tokens must be an integer >= 1"),
                                            ({"history_lengths": "yes"}, "history_lengths must be true or false"),
                                            ({"history_drafts": 1}, "history_drafts must be true or false"),
                                            ({"chunk_size": -1}, "chunk_size must be")])
def test_bad_options_fail_clearly(options, match):
    with pytest.raises(StrategyConfigError, match=match):
        make_strategy("multiscope", options)


def test_the_simulated_global_tree_starts_with_the_epoch_before():
    """A real engine that ran the previous epoch holds its responses in its global tree; the
    simulator's drafter starts the same way, and without an earlier epoch it starts empty."""
    import numpy as np

    from verl_ext.sim.drafting import ReplayDrafter
    from verl_ext.spec.options import SpecOptions

    tr = _trace(groups=3, samples=2, seed=7)
    rows = np.arange(len(tr))
    spec = SpecOptions(scopes="request+global")
    held = ReplayDrafter(spec, TraceSource(tr), "exact", history=(tr, rows)).index.stats()["global_tokens_held"]
    assert held == int(tr.response_lengths().sum())
    assert ReplayDrafter(spec, TraceSource(tr), "exact").index.stats()["global_tokens_held"] == 0


def test_history_drafts_reach_every_drafting_engine_and_the_rollout_is_exact():
    """A later epoch whose responses repeat the earlier ones: each engine gets the history trees of
    the prompts whose groups arrive (served by the history provider, charged as a real engine's
    delivery), drafts from them, and the responses are the trace's; switched off, no tree moves."""
    from test_rhyme import repeating_trace

    from verl_ext.pipe.arms import make_arm
    from verl_ext.sim.runner import build_requests, run_arm, select_epoch

    tr = repeating_trace(groups=4, samples=3, length=120, seed=3)
    _, rows, history = select_epoch(tr, 1)

    def run(label):
        strategy, spec = make_arm(label, 8, allow_history=True, cost=_cost())
        arm = run_arm(label, strategy, spec, tr, rows, history, _cost(), 2, "auto", build_requests(tr, rows, 400),
                      dispatcher=False)
        return strategy, arm

    on, arm = run("multiscope[dgds=false,chunk_size=32]")
    assert sum(r["output_tokens"] for r in arm.records) == int(tr.response_lengths()[rows].sum())
    m = on.metrics()
    assert m["engine_group_drop_failures"] == 0
    assert m["served_histories"] == 2 * 4 and m["history_failures"] == 0  # every prompt to both engines
    assert arm.metrics["history_tokens_received"] == 2 * 12 * 120
    assert sum(i.scope_tokens["history"][1] for i in arm.instances) > 0  # history draft tokens accepted
    off, arm_off = run("multiscope[dgds=false,chunk_size=32,history_drafts=false]")
    assert off.metrics()["served_histories"] == 0 and arm_off.metrics["history_tokens_received"] == 0
    assert arm.metrics["accepted_tokens"] > arm_off.metrics["accepted_tokens"]
