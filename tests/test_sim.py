"""The simulator: virtual time, simulated instances against a per-step reference, invariants
(token conservation, no request lost, KV capacity never exceeded without preemption), draft
replay modes, the oracle, and bad input."""

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from verl_ext.compare.run import run_strategy
from verl_ext.engine.instance import GenRequest, SamplingSpec
from verl_ext.pipe import make_strategy
from verl_ext.pipe.oracle import TRUE_LEN
from verl_ext.pipe.strategy import StrategyConfigError
from verl_ext.sim.clock import SimulationStalled, run_virtual
from verl_ext.perf.cost import CostModel
from verl_ext.sim.drafting import ReplayDrafter
from verl_ext.sim.instance import SimInstance
from verl_ext.sim.source import TraceSource
from verl_ext.spec.options import SpecOptions
from verl_ext.trace.format import Trace


def _cost(cap=100_000, seqs=64, batched=8192, **kw):
    base = dict(name="toy", overhead_s=0.004, weight_s=0.002, token_s=1e-4, kv_token_s=2e-7, prefill_token_s=5e-6,
                draft_token_s=0.0, kv_capacity_tokens=cap, max_num_seqs=seqs, max_batched_tokens=batched)
    base.update(kw)
    return CostModel(**base)


def _trace(groups=6, samples=4, vocab=40, lo=5, hi=300, seed=0, similar=True):
    """Responses of a group share a base text (so group drafting has something to find)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        base = rng.integers(0, vocab, hi + 60)
        prompt = rng.integers(0, vocab, int(rng.integers(8, 40))).tolist()
        for j in range(samples):
            n, off = int(rng.integers(lo, hi)), int(rng.integers(0, 60))  # siblings run ahead or behind
            resp = base[off:off + n].copy() if similar else rng.integers(0, vocab, n)
            flips = rng.random(n) < 0.05
            resp[flips] = rng.integers(0, vocab, int(flips.sum()))
            rows.append(dict(epoch=0, step=0, prompt_uid=f"p{g}", sample_index=j, prompt_ids=prompt,
                             response_ids=resp.tolist(), reward=float(j % 2), finish_reason="stop",
                             instance=None, submit_s=float("nan"), finish_s=float("nan")))
    return Trace.from_rows(rows)


def _requests(tr, max_tokens=10_000):
    return [GenRequest(f"{tr.prompt_uid[i]}-s{tr.sample_index[i]}", str(tr.prompt_uid[i]), tr.prompt(i).tolist(),
                       SamplingSpec(max_tokens=max_tokens), sample_index=int(tr.sample_index[i]),
                       extra={TRUE_LEN: len(tr.response(i))}) for i in range(len(tr))]


def _run(strategy, instances, requests):
    async def main():
        loop = asyncio.get_running_loop()
        return await run_strategy(make_strategy(strategy), instances, requests, lambda r, t: 0.0,
                                  clock=loop.time, sample_telemetry=False)

    return run_virtual(main())


def test_virtual_time_jumps_and_stalls_are_errors():
    async def sleepy():
        await asyncio.sleep(3600.0)
        return asyncio.get_running_loop().time()

    assert run_virtual(sleepy()) == pytest.approx(3600.0)

    async def stuck():
        await asyncio.get_running_loop().create_future()  # nothing will ever resolve it

    with pytest.raises(SimulationStalled, match="stalled"):
        run_virtual(stuck())


def _reference(cost, arrivals):
    """Per-step reference of the instance model (plain decoding): arrivals = [(t, prompt_len,
    length)]; returns finish times. Same rules as SimInstance, one Python iteration per step."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    waiting, running, finish = [], [], {}
    pos, kv = [0] * len(arrivals), [0] * len(arrivals)
    t = 0.0
    while pending or waiting or running:
        while pending and arrivals[pending[0]][0] <= t:
            waiting.append(pending.pop(0))
        cap = cost.kv_capacity_tokens
        while len(running) > 1 and sum(kv[i] for i in running) + len(running) > cap:
            v = running.pop()
            kv[v] = 0
            waiting.insert(0, v)
        prefill = 0
        while waiting and len(running) < cost.max_num_seqs:
            i = waiting[0]
            ctx = arrivals[i][1] + pos[i]
            if sum(kv[j] for j in running) + ctx + len(running) + 1 > cap:
                break
            if prefill and prefill + ctx > cost.max_batched_tokens:
                break
            waiting.pop(0)
            kv[i] = ctx
            prefill += ctx
            running.append(i)
        if not running:
            t = arrivals[pending[0]][0]
            continue
        t += float(cost.step_time(len(running), sum(kv[i] for i in running), prefill, 0))
        for i in list(running):
            pos[i] += 1
            kv[i] += 1
            if pos[i] == arrivals[i][2]:
                running.remove(i)
                kv[i] = 0
                finish[i] = t
    return [finish[i] for i in range(len(arrivals))]


@pytest.mark.parametrize("cap,seqs,batched", [(100_000, 64, 8192), (400, 64, 8192), (100_000, 3, 8192), (2000, 8, 60)])
def test_instance_matches_per_step_reference(cap, seqs, batched):
    """Closed-form planning, mid-plan arrivals, admission limits and preemption give the same
    finish times as stepping one token at a time."""
    rng = random.Random(cap + seqs)
    cost = _cost(cap=cap, seqs=seqs, batched=batched)
    tr = _trace(groups=5, samples=4, lo=3, hi=120, seed=seqs)
    reqs = _requests(tr)
    arrivals = [(rng.uniform(0, 0.5) if i % 3 else 0.0, len(r.prompt_ids), len(tr.response(i))) for i, r in enumerate(reqs)]
    inst = SimInstance("sim-0", cost, TraceSource(tr))

    async def one(req, t):
        await asyncio.sleep(t)
        c = await inst.generate(req)
        return asyncio.get_running_loop().time(), c

    async def main():
        return await asyncio.gather(*(one(r, a[0]) for r, a in zip(reqs, arrivals)))

    got = run_virtual(main())
    want = _reference(cost, arrivals)
    np.testing.assert_allclose([t for t, _ in got], want, rtol=1e-9)
    for i, (_, c) in enumerate(got):
        assert list(c.token_ids) == tr.response(i).tolist()
    assert inst.kv_peak <= cap
    if cap == 900:
        assert inst.preemptions > 0


@pytest.mark.parametrize("spec,mode", [(None, None), ("request", "cached"), ("request+group", "lockstep"), ("request+group", "exact")])
def test_invariants_under_pressure(spec, mode):
    """Tight KV capacity and few slots: every request finishes with exactly its trace tokens,
    tokens are conserved, and KV usage never exceeds capacity."""
    tr = _trace(groups=8, samples=4, seed=3)
    src = TraceSource(tr)
    drafter = None if spec is None else ReplayDrafter(SpecOptions(scopes=spec, k=4), src, mode)
    cost = _cost(cap=700, seqs=6)
    insts = [SimInstance(f"sim-{i}", cost, src, drafter) for i in range(3)]
    arm = _run("baseline", insts, _requests(tr))
    assert len(arm.completions) == len(tr)
    for i, c in enumerate(arm.completions):
        assert list(c.token_ids) == tr.response(i).tolist() and c.finish_reason == "stop"
    total = int(tr.response_lengths().sum())
    assert sum(i.counters.generated_tokens for i in insts) == total == arm.metrics["output_tokens"]
    assert all(i.kv_peak <= cost.kv_capacity_tokens for i in insts)
    assert sum(i.preemptions for i in insts) > 0
    assert all(not i.running and not i.waiting and i._kv == 0 for i in insts)
    if spec:
        assert arm.metrics["tokens_per_step"] > 1.0 and arm.metrics["draft_tokens"] > 0


def test_cached_replay_equals_exact_for_request_scope():
    tr = _trace(groups=6, samples=4, seed=5)
    src = TraceSource(tr)
    out = {}
    for mode in ("cached", "exact"):
        insts = [SimInstance(f"sim-{i}", _cost(), src, ReplayDrafter(SpecOptions(k=6), src, mode)) for i in range(2)]
        arm = _run("baseline", insts, _requests(tr))
        out[mode] = ([c.num_steps for c in arm.completions], arm.metrics["draft_tokens"], arm.metrics["wall_s"])
    assert out["cached"][:2] == out["exact"][:2]
    assert out["cached"][2] == pytest.approx(out["exact"][2], rel=1e-9)


def test_group_scope_helps_and_lockstep_is_close_to_exact():
    tr = _trace(groups=8, samples=4, seed=7)
    src = TraceSource(tr)
    tps = {}
    for spec, mode in (("request", "cached"), ("request+group", "lockstep"), ("request+group", "exact")):
        insts = [SimInstance(f"sim-{i}", _cost(), src, ReplayDrafter(SpecOptions(scopes=spec, k=6), src, mode)) for i in range(2)]
        tps[mode] = _run("baseline", insts, _requests(tr)).metrics["tokens_per_step"]
    assert tps["exact"] > tps["cached"] * 1.05, tps  # siblings' text is drafted
    assert tps["lockstep"] == pytest.approx(tps["exact"], rel=0.1)


def _with_extra(reqs, **extra):
    return [dataclasses.replace(r, extra={**r.extra, **extra}) for r in reqs]


@pytest.mark.parametrize("mode", ["lockstep", "exact"])
def test_per_request_windows_cap_drafts_like_the_engine(mode):
    """``spec_window`` (what the vLLM proposer reads per request) caps a request's drafts per
    step in every replay mode: 0 decodes plainly, 2 drafts at most 2 tokens a step."""
    tr = _trace(groups=6, samples=4, seed=7)
    src = TraceSource(tr)

    def arm(reqs):
        insts = [SimInstance(f"sim-{i}", _cost(), src, ReplayDrafter(SpecOptions(scopes="request+group", k=6), src, mode))
                 for i in range(2)]
        out = _run("baseline", insts, reqs)
        for i, c in enumerate(out.completions):
            assert list(c.token_ids) == tr.response(i).tolist()
        return out.metrics, sum(x.counters.request_steps for x in insts)

    full, _ = arm(_requests(tr))
    off, steps = arm(_with_extra(_requests(tr), spec_window=0))
    assert off["draft_tokens"] == 0 and steps == int(tr.response_lengths().sum())  # one token per step
    two, steps = arm(_with_extra(_requests(tr), spec_window=2))
    assert 0 < two["draft_tokens"] <= 2 * steps and two["tokens_per_step"] <= 3.0
    assert full["tokens_per_step"] > two["tokens_per_step"] > 1.0


def test_per_request_scopes_narrow_exact_replay():
    """``spec_scopes="request"`` keeps a request off its group's tree (exact replay), as on the
    engine: group drafting finds the siblings' shared text, request-only drafting does not."""
    tr = _trace(groups=8, samples=4, seed=7)
    src = TraceSource(tr)
    tps = {}
    for name, reqs in (("group", _requests(tr)), ("request", _with_extra(_requests(tr), spec_scopes="request")),
                       ("bad", _with_extra(_requests(tr), spec_scopes="nonsense"))):
        insts = [SimInstance(f"sim-{i}", _cost(), src, ReplayDrafter(SpecOptions(scopes="request+group", k=6), src, "exact"))
                 for i in range(2)]
        tps[name] = _run("baseline", insts, reqs).metrics
    cached = [SimInstance(f"sim-{i}", _cost(), src, ReplayDrafter(SpecOptions(scopes="request", k=6), src, "cached"))
              for i in range(2)]
    alone = _run("baseline", cached, _requests(tr)).metrics
    assert tps["group"]["tokens_per_step"] > tps["request"]["tokens_per_step"] * 1.05
    assert tps["request"]["draft_tokens"] == alone["draft_tokens"]  # exactly request-scope drafting
    assert tps["bad"]["draft_tokens"] == 0  # a bad per-request value means no drafts, as on the engine


def test_oracle_beats_baseline_on_a_long_tail_and_needs_true_lengths():
    rng = np.random.default_rng(11)
    rows = []
    for g in range(16):
        for j in range(4):
            n = int(min(2000, rng.lognormal(4.5, 1.0))) + 1
            rows.append(dict(epoch=0, step=0, prompt_uid=f"p{g}", sample_index=j, prompt_ids=[1, 2, 3],
                             response_ids=rng.integers(0, 50, n).tolist(), reward=0.0, finish_reason="stop",
                             instance=None, submit_s=float("nan"), finish_s=float("nan")))
    tr = Trace.from_rows(rows)
    src = TraceSource(tr)
    walls = {}
    for s in ("baseline", "oracle"):
        insts = [SimInstance(f"sim-{i}", _cost(seqs=4), src) for i in range(4)]
        walls[s] = _run(s, insts, _requests(tr)).metrics["wall_s"]
    assert walls["oracle"] < walls["baseline"]
    bare = [GenRequest("r", "g", [1], SamplingSpec())]
    with pytest.raises(StrategyConfigError, match="true response length"):
        _run("oracle", [SimInstance("sim-0", _cost(), src)], bare)


def test_abort_returns_partial_tokens_and_frees_kv():
    tr = _trace(groups=1, samples=2, lo=200, hi=300, seed=2)
    inst = SimInstance("sim-0", _cost(), TraceSource(tr))
    reqs = _requests(tr)

    async def main():
        task = asyncio.ensure_future(inst.generate(reqs[0]))
        other = asyncio.ensure_future(inst.generate(reqs[1]))
        await asyncio.sleep(0.2)
        await inst.abort(reqs[0].request_id)
        return await task, await other

    aborted, done = run_virtual(main())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < len(tr.response(0))
    assert list(aborted.token_ids) == tr.response(0)[: len(aborted.token_ids)].tolist()
    assert list(done.token_ids) == tr.response(1).tolist()
    assert inst._kv == 0 and not inst.running


def test_bad_requests_are_refused_clearly():
    tr = _trace(groups=1, samples=1, lo=50, hi=60)
    inst = SimInstance("sim-0", _cost(cap=40), TraceSource(tr))
    req = _requests(tr)[0]
    with pytest.raises(ValueError, match="KV tokens, more than the instance's capacity"):
        run_virtual(inst.generate(req))
    stranger = GenRequest("x", "nope", [1], SamplingSpec())
    with pytest.raises(ValueError, match="not in its trace"):
        run_virtual(SimInstance("sim-1", _cost(), TraceSource(tr)).generate(stranger))


def test_parallel_lockstep_precompute_equals_sequential():
    tr = _trace(groups=40, samples=3, hi=80, seed=9)
    src = TraceSource(tr)
    spec = SpecOptions(scopes="request+group", k=4)
    one, two = ReplayDrafter(spec, src, "lockstep"), ReplayDrafter(spec, src, "lockstep")
    one.precompute(workers=1)
    two.precompute(workers=2)  # 40 groups >= 16 per worker: forked workers
    assert one._cache.keys() == two._cache.keys() and len(one._cache) == len(tr)
    for k in one._cache:
        assert all((a == b).all() for a, b in zip(one._cache[k], two._cache[k])), k


def test_an_instance_takes_over_what_an_earlier_epochs_engine_learned():
    """``SimInstance.carry_state``: the draft selector (RLHFSpec's ``F``) and the batch cut-off's
    measured acceptance move to the next epoch's instance, as they stay on an engine that serves
    both; an instance without them keeps its own (none)."""
    tr = _trace()
    spec = SpecOptions(scopes="request+group", k=4, select=True, batch_cutoffs=((256, 0.3, 8),))
    before, after = (SimInstance(f"sim-{i}", _cost(), TraceSource(tr), ReplayDrafter(spec, TraceSource(tr), "exact"))
                     for i in range(2))
    before.selector.observe(np.full((1, 3), 0.5, dtype=np.float32), np.array([3]), np.array([2]))
    before._cutoff.observe(10, 4)
    assert after.selector is not before.selector and after._cutoff.stats() != before._cutoff.stats()
    after.carry_state(before)
    assert after.selector is before.selector and after.selector.acceptance.seen.sum() == 3
    assert after._cutoff is before._cutoff and after._policy.cutoff.cutoff is before._cutoff
    plain = SimInstance("plain", _cost(), TraceSource(tr))
    plain.carry_state(before)
    assert plain.selector is None and plain._cutoff is None


def test_warm_epochs_roll_the_first_epoch_out_before_the_timed_one(tmp_path):
    """``--warm-epochs`` on the committed two-epoch trace: plain decoding is unchanged, and
    ``rlhfspec``'s timed epoch starts from the acceptance map its first epoch taught it, so its
    drafts and time differ from a cold start; the same seed gives the same figures."""
    from pathlib import Path

    from verl_ext.sim.runner import SimConfig, run_sim_ab
    from verl_ext.trace.format import read_trace, write_trace

    full = read_trace(Path(__file__).resolve().parent.parent / "data" / "traces" / "smollm2_arith_e2.parquet")
    trace = str(tmp_path / "first_12_prompts.parquet")  # both epochs of 12 of its 64 prompts
    write_trace(full.select(np.isin(full.prompt_uid, sorted(set(full.prompt_uid.tolist()))[:12])), trace)

    def sim(warm, name):
        cfg = SimConfig(strategies=["baseline", "rlhfspec"], trace=trace, preset="cpu-smollm2", instances=2,
                        dispatcher=False, warm_epochs=warm, out=str(tmp_path / name))
        return run_sim_ab(cfg, progress=False)["strategies"]

    cold, warm, again = sim(False, "cold"), sim(True, "warm"), sim(True, "again")
    assert warm["baseline"]["wall_s"] == cold["baseline"]["wall_s"]
    assert warm["rlhfspec"]["draft_tokens"] != cold["rlhfspec"]["draft_tokens"]
    assert warm["rlhfspec"]["output_tokens"] == cold["rlhfspec"]["output_tokens"]
    assert again["rlhfspec"]["wall_s"] == warm["rlhfspec"]["wall_s"]
    with pytest.raises(ValueError, match="warm-epochs"):
        SimConfig(warm_epochs=True, pipeline="sync").validate()


def test_exact_replay_caches_a_batch_only_while_it_runs(monkeypatch):
    """Workload-aware selection replays every step of a batch from its cached index keys, rows
    and ends (``ReplayDrafter._batch``); batches that change (admissions, finishes, preemptions
    on a tight cache) give exactly the figures of rebuilding them every step."""
    tr = _trace(groups=8, samples=4, seed=3)
    spec = SpecOptions(scopes="request+group", k=4, select=True)

    def run():
        src = TraceSource(tr)
        drafter = ReplayDrafter(spec, src, "exact")
        insts = [SimInstance(f"sim-{i}", _cost(cap=800, seqs=6), src, drafter) for i in range(2)]
        return _run("baseline", insts, _requests(tr)).metrics, sum(i.preemptions for i in insts)

    cached, preempted = run()
    assert preempted > 0 and cached["draft_tokens"] > 0

    def rebuilt(self, keys):
        ends = np.fromiter((self._ends[k] for k in keys), dtype=np.int64, count=len(keys))
        return keys, [self._ik[k] for k in keys], [self._rows[k] for k in keys], ends

    monkeypatch.setattr(ReplayDrafter, "_batch", rebuilt)
    assert run()[0] == cached
