"""Registry, options validation, the instance pool and the baseline strategy's dispatch rule.

The pool and strategy are engine-agnostic; here they run over a scripted in-process Instance
whose latency is controlled, so the dispatch order and load accounting can be asserted exactly.
The same strategy runs on the real engine in test_vllm_engine.py.
"""

import asyncio
import dataclasses

import pytest

from _util import ScriptedInstance, requests as _requests

from verl_ext.engine.instance import SamplingSpec
from verl_ext.pipe import InstancePool, StrategyConfigError, UnknownStrategyError, available_strategies, make_strategy
from verl_ext.pipe.strategy import Strategy, register_strategy


def test_registry_lists_only_working_strategies():
    assert "baseline" in available_strategies()
    with pytest.raises(UnknownStrategyError, match="available: .*baseline"):
        make_strategy("seer-not-yet")


def test_baseline_rejects_options():
    with pytest.raises(StrategyConfigError, match="unknown option"):
        make_strategy("baseline", {"chunk_size": 8})


def test_custom_strategy_options_are_validated():
    @dataclasses.dataclass(frozen=True)
    class Opts:
        k: int = 1

        def __post_init__(self):
            if self.k < 1:
                raise ValueError("k must be >= 1")

    @register_strategy("test_opts")
    class WithOpts(Strategy):
        Options = Opts

        async def submit(self, request, pool):
            return await pool.run(pool.least_loaded(), request)

    assert make_strategy("test_opts", {"k": 3}).options.k == 3
    with pytest.raises(StrategyConfigError, match="k must be >= 1"):
        make_strategy("test_opts", {"k": 0})
    with pytest.raises(ValueError, match="already registered"):
        register_strategy("test_opts")(type("Other", (Strategy,), {"submit": WithOpts.submit}))


async def test_baseline_balances_least_in_flight_and_keeps_order():
    insts = [ScriptedInstance("a"), ScriptedInstance("b")]
    pool = InstancePool(insts, seed=0)
    reqs = _requests(10)
    out = await make_strategy("baseline").rollout(reqs, pool)
    assert [c.request_id for c in out] == [r.request_id for r in reqs]
    # all dispatched at once: least-in-flight alternates, so the load splits 5/5
    assert sorted(len(i.seen) for i in insts) == [5, 5]
    assert all(count == 0 for count in pool.inflight.values())
    assert len(pool.records) == 10 and all(r.output_tokens == 4 for r in pool.records)


async def test_pool_sticky_request_ids():
    insts = [ScriptedInstance("a"), ScriptedInstance("b")]
    pool = InstancePool(insts, seed=1)
    first = pool.least_loaded("turn-id")
    pool.inflight[first.name] += 5  # even when it is the busier one now
    assert pool.least_loaded("turn-id") is first
    assert pool.least_loaded("other") is not first


async def test_failed_request_aborts_the_others():
    class Failing(ScriptedInstance):
        async def generate(self, request, on_tokens=None):
            if request.request_id == "r3":
                raise RuntimeError("engine died")
            return await super().generate(request, on_tokens)

    slow = Failing("a", delay=5.0)
    pool = InstancePool([slow], seed=0)
    with pytest.raises(RuntimeError, match="engine died"):
        await asyncio.wait_for(make_strategy("baseline").rollout(_requests(6), pool), 2.0)
    await asyncio.sleep(0)
    assert slow.running == 0  # the others were cancelled, none left running
    assert pool.inflight["a"] == 0


def test_pool_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        InstancePool([ScriptedInstance("a"), ScriptedInstance("a")])


def test_sampling_spec_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec(max_tokens=0)


@pytest.mark.parametrize("name, options", [("seer", {}), ("rhyme", {}), ("rlhfspec", {"batch_cutoff": True}),
                                           ("specactor", {}),
                                           ("seer", {"draft_profile": "cpu-smollm2-avx2"}),
                                           ("rlhfspec", {"profile": "cpu-smollm2-avx2", "batch_cutoff": True}),
                                           ("specactor", {"profile": "cpu-smollm2-avx2"})])
def test_drafting_strategies_start_their_engines_with_the_batch_cutoff(name, options):
    """The engines of ``seer``, ``rhyme`` and ``specactor`` (``rlhfspec`` on request: its
    selection drafts by predicted gain) draft only below the batch cut-off of their cost model
    (the A/B runner's ``--preset``, or the strategy's profile option), one table from one rule
    (``verl_ext.spec.cutoff.cutoff_table``); ``batch_cutoff=false`` drafts at every batch, and so
    do engines without a cost model."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.spec.cutoff import CUTOFF_DRAFT, cutoff_table

    given = load_cost_model("h100-7b")
    profile = options.get("draft_profile") or options.get("profile")
    cost = load_cost_model(profile) if profile else given
    draft = make_strategy(name, options).options.aimd_start if name == "rhyme" else CUTOFF_DRAFT
    spec = make_strategy(name, options).engine_spec(given)
    assert spec.batch_cutoffs == cutoff_table(cost, draft) and spec.batch_cutoff() is not None
    assert any(b < cost.max_num_seqs for _, _, b in spec.batch_cutoffs)  # the table binds somewhere
    assert make_strategy(name, {**options, "batch_cutoff": False}).engine_spec(given).batch_cutoffs == ()
    if name in ("seer", "rhyme"):  # (rlhfspec's selection and specactor's ladder need a cost model)
        assert make_strategy(name, {}).engine_spec(None).batch_cutoffs == ()
    with pytest.raises(StrategyConfigError, match="batch_cutoff must be true or false"):
        make_strategy(name, {"batch_cutoff": "yes"})
    assert make_strategy(name).options.batch_cutoff is (name != "rlhfspec")
