"""What the simulator charges for verl_ext's host-side paths (issue 35 part 2): veRL's one
dispatcher actor (``verl_ext.sim.dispatcher``) and history delivery to the engines
(``SimInstance.drafter_call``), at the costs of ``verl_ext.sim.host_costs``."""

import asyncio

import pytest

from test_rhyme import repeating_trace
from test_sim import _cost, _trace

from verl_ext.sim.clock import run_virtual
from verl_ext.sim.dispatcher import SimDispatcher
from verl_ext.engine.drafter_ops import GroupWrite


def test_dispatcher_is_one_fifo_server():
    d = SimDispatcher(s_per_call=1.0, s_per_token=0.01, s_per_prompt_token=0.0)

    async def main():
        loop = asyncio.get_running_loop()
        done = {}

        async def call(name, calls, tokens, at):
            await asyncio.sleep(at)
            await d.carry(calls, tokens)
            done[name] = loop.time()

        await asyncio.gather(call("a", 1, 0, 0.0), call("b", 1, 0, 0.0), call("c", 0, 100, 0.5), call("late", 1, 0, 10.0))
        return done

    done = run_virtual(main())
    assert done == pytest.approx({"a": 1.0, "b": 2.0, "c": 3.0, "late": 11.0})
    assert d.stats() == pytest.approx({"dispatcher_calls": 3, "dispatcher_busy_s": 4.0, "dispatcher_wait_s": 1.0 + 1.5})
    with pytest.raises(ValueError, match=">= 0"):
        SimDispatcher(s_per_call=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        SimDispatcher(s_per_prompt_token=-1.0)


def charged_requests():
    from verl_ext.sim.runner import build_requests, select_epoch

    tr = _trace(groups=8, samples=4)
    _, rows, history = select_epoch(tr, None)
    return build_requests(tr, rows, 2000)


def _baseline(dispatcher, instances=2):
    from verl_ext.pipe import make_strategy
    from verl_ext.sim.runner import run_arm, select_epoch

    tr = _trace(groups=8, samples=4)
    _, rows, history = select_epoch(tr, None)
    reqs = charged_requests()
    return run_arm("baseline", make_strategy("baseline"), None, tr, rows, history, _cost(), instances, "auto", reqs,
                   dispatcher=dispatcher)


def test_every_call_passes_the_dispatcher(monkeypatch):
    import verl_ext.sim.host_costs as hc

    free = _baseline(False)
    monkeypatch.setattr(hc, "DISPATCHER_S_PER_CALL", 0.05)
    monkeypatch.setattr(hc, "DISPATCHER_S_PER_TOKEN", 1e-4)
    monkeypatch.setattr(hc, "DISPATCHER_S_PER_PROMPT_TOKEN", 1e-3)
    charged = _baseline(True)
    m = charged.metrics
    assert m["dispatcher_calls"] == 32 and "dispatcher_calls" not in free.metrics
    prompts = sum(len(r.prompt_ids) for r in charged_requests())
    assert m["dispatcher_busy_s"] == pytest.approx(32 * 0.05 + m["output_tokens"] * 1e-4 + prompts * 1e-3)
    assert m["dispatcher_wait_s"] > 0  # the step's 32 submissions queue behind each other
    assert m["output_tokens"] == free.metrics["output_tokens"]
    assert m["wall_s"] > free.metrics["wall_s"] + 0.05


def _histospec(monkeypatch, rpc=0.0, build=0.0):
    import verl_ext.sim.host_costs as hc
    from verl_ext.pipe.arms import make_arm
    from verl_ext.sim.runner import build_requests, run_arm, select_epoch

    monkeypatch.setattr(hc, "HISTORY_RPC_S_PER_TOKEN", rpc)
    monkeypatch.setattr(hc, "HISTORY_BUILD_S_PER_TOKEN", build)
    tr = repeating_trace(groups=4, samples=4, length=400, seed=2)
    _, rows, history = select_epoch(tr, 1)
    reqs = build_requests(tr, rows, 2000)
    strategy, spec = make_arm("rhyme[histopipe=false]", 8, allow_history=True, cost=_cost())
    return run_arm("rhyme", strategy, spec, tr, rows, history, _cost(), 2, "auto", reqs, dispatcher=False)


def test_history_delivery_stalls_the_engines_and_trees_come_in_late(monkeypatch):
    free = _histospec(monkeypatch)
    m0 = free.metrics
    # every engine gets every prompt's history (HistoSpec alone): 4 prompts x 4 responses x 400
    assert m0["history_tokens_received"] == 2 * 16 * 400 and m0["history_stall_s"] == 0
    assert m0["speculation_rate"] > 0.5
    stalled = _histospec(monkeypatch, rpc=1e-4).metrics
    assert stalled["history_stall_s"] == pytest.approx(2 * 16 * 400 * 1e-4)
    assert stalled["wall_s"] == pytest.approx(m0["wall_s"] + 16 * 400 * 1e-4, rel=0.05)
    assert stalled["accepted_tokens"] == m0["accepted_tokens"]  # the trees are in when decoding starts
    # a build longer than the rollout: no request ever drafts from its history
    never = _histospec(monkeypatch, build=1.0).metrics
    assert never["accepted_tokens"] == 0 and never["output_tokens"] == m0["output_tokens"]
    # trees in part-way through: the requests draft from them for their later tokens only
    late = _histospec(monkeypatch, build=m0["wall_s"] / (2 * 16 * 400 * 2)).metrics
    assert 0 < late["accepted_tokens"] < m0["accepted_tokens"]
    assert late["wall_s"] > m0["wall_s"]


def test_simulated_engines_model_history_delivery_only():
    from verl_ext.sim.instance import SimInstance
    from verl_ext.sim.source import TraceSource

    inst = SimInstance("sim-0", _cost(), TraceSource(_trace(groups=2, samples=2)))
    assert not inst.drafting  # no drafter: strategies deliver no history here
    with pytest.raises(NotImplementedError, match="GroupWrite"):
        run_virtual(inst.drafter_call(GroupWrite(True)))
