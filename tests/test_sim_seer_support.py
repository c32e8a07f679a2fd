"""Simulator support for Seer: draft thresholds of a cost model, adaptive draft length in the
simulated instances (all replay modes), and prefix caching of chunk continuations."""

import asyncio
import json

import numpy as np
import pytest

from test_sim import _cost, _requests, _run, _trace
from verl_ext.engine.instance import FINISH_LENGTH, GenRequest, SamplingSpec
from verl_ext.sim.clock import run_virtual
from verl_ext.perf.cost import available_presets, load_cost_model
from verl_ext.sim.drafting import ReplayDrafter, split_schedule, split_schedules
from verl_ext.sim.instance import SimInstance
from verl_ext.cli import main as cli_main
from verl_ext.sim.source import TraceSource
from verl_ext.spec.adaptive import draft_caps
from verl_ext.spec.options import SpecOptions


# -- draft thresholds -----------------------------------------------------------------------------
def test_draft_thresholds_of_constructed_models():
    c = _cost()  # overhead 4 ms, weight 2 ms, token 0.1 ms, kv 2e-7 s, no draft surcharge
    t = c.draft_thresholds()
    assert t["knee_tokens"] == 60  # (4 + 2) ms / 0.1 ms
    # one request at 4096 KV tokens: 4 + max(2, 0.1 (1 + k)) + 0.8192 <= 2 (4 + 2 + 0.8192) ms -> 1 + k <= 88.19
    assert t["k_single"] == 87 and t["kv_tokens"] == 4096
    for kw in (dict(draft_token_s=3e-4), dict(weight_s=0.0, kv_token_s=1e-6), dict(overhead_s=0.0005)):
        m = _cost(**kw)
        t = m.draft_thresholds(kv_tokens=1000)
        assert t["knee_tokens"] == int(np.floor((m.overhead_s + m.weight_s) / (m.token_s + m.draft_token_s) + 1e-9))
        k = t["k_single"]
        assert m.step_time(1, 1000, 0, k) <= 2 * m.step_time(1, 1000)
        assert k == 128 or m.step_time(1, 1000, 0, k + 1) > 2 * m.step_time(1, 1000)
        # a step of knee_tokens tokens (drafts included) costs at most twice the fixed part, KV aside
        n = t["knee_tokens"]
        assert m.step_time(1, 0, 0, n - 1) <= 2 * (m.overhead_s + m.weight_s) + 1e-12
    free = _cost(token_s=0.0)  # extra tokens cost nothing: no batch threshold, longest drafts
    assert free.draft_thresholds() == {"knee_tokens": 0, "k_single": 128, "kv_tokens": 4096}
    dear = _cost(overhead_s=0.0, weight_s=0.0, token_s=1.0, draft_token_s=10.0, kv_token_s=0.0)
    assert dear.draft_thresholds()["k_single"] == 1  # even one draft is too dear: the floor


def test_draft_thresholds_of_presets_and_cli(capsys):
    for name in available_presets():
        t = load_cost_model(name).draft_thresholds()
        assert t["knee_tokens"] > 0 and 1 <= t["k_single"] <= 128, name
    assert load_cost_model("h100-7b").draft_thresholds()["knee_tokens"] == 214
    assert cli_main(["fit", "thresholds", "h100-7b", "cpu-smollm2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("h100-7b: draft thresholds: knee_tokens 214")
    assert cli_main(["profile"]) == 2 and "--out is required" in capsys.readouterr().err  # the old spelling
    assert cli_main(["fit", "grid"]) == 2 and "--out" in capsys.readouterr().err


def test_profile_json_records_thresholds_and_still_loads(tmp_path):
    from verl_ext.measure.grid import write_profile
    from verl_ext.perf.grid import ProfileSample, fit_cost_model

    truth = _cost(name="t", weight_s=0.0, kv_token_s=5e-6)
    samples = []
    for B in (1, 4, 16, 32):
        for P in (16, 200):
            samples.append(ProfileSample("decode", steps=20, time_s=truth.step_time(B, B * P) * 20, batch=B * 20,
                                         kv_tokens=B * P * 20))
    fit, rep = fit_cost_model(samples, truth)
    path = tmp_path / "p.json"
    doc = write_profile(path, fit, rep, {"engine": {}, "timings": {}, "samples": samples})
    assert json.loads(path.read_text())["fit"]["draft_thresholds"] == fit.draft_thresholds() == doc["fit"]["draft_thresholds"]
    assert load_cost_model(str(path)) == fit


# -- adaptive drafting ----------------------------------------------------------------------------
class _Checked(SimInstance):
    """Checks every plan against the caps and the KV/cache invariants."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.plans = []  # (batch, most drafts in one step of the plan)

    def _make_plan(self):
        super()._make_plan()
        E, D, _, _ = self._plan
        B = len(self.running)
        self.plans.append((B, 0 if D is None else int(D.sum(axis=0).max())))
        if D is not None and self._adaptive:
            spec = self.drafter.spec
            assert (D <= spec.k).all()
            assert (D.sum(axis=0) <= max(0, spec.knee_tokens - B)).all(), (B, D.sum(axis=0))
        assert (E is None or (E >= 1).all())

    def _admit(self):
        super()._admit()
        assert self._kv + self.prefix_cached_tokens <= self.cost.kv_capacity_tokens
        assert self.prefix_cached_tokens == sum(self._pcache.values())


def _arm(tr, spec, mode, n=2, cost=None, strategy="baseline", reqs=None, **inst_kw):
    src = TraceSource(tr)
    drafter = None if spec is None else ReplayDrafter(spec, src, mode)
    cost = cost or _cost()
    insts = [_Checked(f"sim-{i}", cost, src, drafter, **inst_kw) for i in range(n)]
    arm = _run(strategy, insts, reqs or _requests(tr))
    return arm, insts, drafter


def _conserved(tr, arm, insts):
    assert len(arm.completions) == len(tr)
    for i, c in enumerate(arm.completions):
        assert list(c.token_ids) == tr.response(i).tolist() and c.finish_reason == "stop"
    assert sum(i.counters.generated_tokens for i in insts) == int(tr.response_lengths().sum())
    assert all(not i.running and not i.waiting and i._kv == 0 for i in insts)


def test_split_schedule_conserves_tokens_and_respects_the_cap():
    rng = np.random.default_rng(0)
    d = rng.integers(0, 9, 200)
    e = np.minimum(d + 1, rng.integers(1, 10, 200))
    for cap in (0, 1, 3, 8, 20):
        pe, pd, step, piece = split_schedule(e, d, cap)
        assert (pd <= cap).all() and (pe >= 1).all() and (pe <= cap + 1).all()
        assert (np.bincount(step, weights=pe, minlength=len(e)) == e).all()  # every step's tokens, exactly
        assert (pe <= pd + 1).all()  # a piece accepts at most what it drafted
        assert (piece[step == 0] == np.arange((step == 0).sum())).all()
        if cap >= d.max():
            assert (pe == e).all() and (pd == d).all() and (piece == 0).all()
    pe, pd, _, _ = split_schedule(np.array([5]), np.array([8]), 3)  # 4 accepted of 8: 3 + bonus, then 1
    assert pe.tolist() == [4, 1] and pd.tolist() == [3, 3]


@pytest.mark.parametrize("scopes,mode", [("request", "cached"), ("request+group", "lockstep"), ("request+group", "exact")])
def test_adaptive_caps_drafts_at_large_batch_and_conserves_tokens(scopes, mode):
    tr = _trace(groups=8, samples=4, seed=3)
    full, fi, _ = _arm(tr, SpecOptions(scopes=scopes, k=6), mode, cost=_cost(cap=3000, seqs=12))
    spec = SpecOptions(scopes=scopes, k=6, adaptive=True, knee_tokens=16, sibling_boost=2.0)
    arm, insts, drafter = _arm(tr, spec, mode, cost=_cost(cap=3000, seqs=12))
    _conserved(tr, arm, insts)
    _conserved(tr, full, fi)
    assert 0 < arm.metrics["draft_tokens"] < 0.7 * full.metrics["draft_tokens"]
    plans = [p for i in insts for p in i.plans]
    assert any(B >= 12 for B, _ in plans)
    assert all(d <= max(0, 16 - B) for B, d in plans)  # at B=12 at most 4 drafts per step in all
    assert any(B <= 3 and d > 0 for B, d in plans)  # the tail still drafts
    assert all(f == 1.0 for f in drafter.finished_fraction(sorted(set(tr.prompt_uid.tolist()))))


@pytest.mark.parametrize("mode", ["cached", "exact"])
def test_adaptive_changes_nothing_at_batch_one(mode):
    """One request at a time: the cap is min(k, knee - 1) = k, and so the run is the same."""
    tr = _trace(groups=2, samples=2, seed=4)
    out = []
    for spec in (SpecOptions(k=6), SpecOptions(k=6, adaptive=True, knee_tokens=7, sibling_boost=3.0)):
        arm, insts, _ = _arm(tr, spec, mode, n=1, cost=_cost(seqs=1))
        out.append(([c.num_steps for c in arm.completions], arm.metrics["draft_tokens"], arm.metrics["wall_s"]))
    assert out[0] == out[1] and out[0][1] > 0
    arm, _, _ = _arm(tr, SpecOptions(k=6, adaptive=True, knee_tokens=4), mode, n=1, cost=_cost(seqs=1))
    assert arm.metrics["draft_tokens"] < out[0][1]  # knee 4 at batch 1: at most 3 drafts a step


@pytest.mark.parametrize("scopes,mode", [(None, None), ("request", "cached"), ("request+group", "lockstep"), ("request+group", "exact")])
def test_adaptive_off_and_no_threshold_are_identical(scopes, mode):
    """adaptive with knee_tokens 0 (no batch threshold) = adaptive off; prefix caching changes
    nothing when no request continues (baseline, KV pressure and preemption included)."""
    tr = _trace(groups=8, samples=4, seed=3)
    cost = _cost(cap=700, seqs=6)
    runs = []
    for spec, pc in ((SpecOptions(scopes=scopes or "request", k=4), True),
                     (SpecOptions(scopes=scopes or "request", k=4, adaptive=True, knee_tokens=0), True),
                     (SpecOptions(scopes=scopes or "request", k=4), False)):
        arm, insts, _ = _arm(tr, spec if scopes else None, mode, n=3, cost=cost, prefix_caching=pc)
        _conserved(tr, arm, insts)
        assert sum(i.preemptions for i in insts) > 0
        assert sum(i.prefix_hit_tokens for i in insts) == 0
        runs.append(([c.num_steps for c in arm.completions], arm.metrics["wall_s"], arm.metrics["draft_tokens"],
                     [i.timeline for i in insts], [i.prefill_tokens for i in insts]))
    assert runs[0] == runs[1] == runs[2]


def test_adaptive_lockstep_stays_close_to_exact():
    tr = _trace(groups=8, samples=4, seed=7)
    tps, drafts = {}, {}
    for mode in ("lockstep", "exact"):
        spec = SpecOptions(scopes="request+group", k=6, adaptive=True, knee_tokens=30, sibling_boost=2.0)
        arm, insts, _ = _arm(tr, spec, mode)
        _conserved(tr, arm, insts)
        tps[mode], drafts[mode] = arm.metrics["tokens_per_step"], arm.metrics["draft_tokens"]
    assert tps["lockstep"] == pytest.approx(tps["exact"], rel=0.1), tps
    assert drafts["lockstep"] == pytest.approx(drafts["exact"], rel=0.2), drafts


def test_sibling_finishes_are_counted_once_per_whole_response():
    """A chunk that ends at max_tokens is no finish; its continuation's last token is; the caps
    then favour the request whose group has finished more."""
    tr = _trace(groups=2, samples=2, lo=60, hi=80, seed=1)
    src = TraceSource(tr)
    spec = SpecOptions(scopes="request+group", k=8, adaptive=True, knee_tokens=12, sibling_boost=3.0)
    drafter = ReplayDrafter(spec, src, "lockstep")
    inst = SimInstance("sim-0", _cost(), src, drafter)
    req = _requests(tr)[0]
    chunk = GenRequest("c0", req.group_id, req.prompt_ids, SamplingSpec(max_tokens=20), sample_index=req.sample_index)
    done = run_virtual(inst.generate(chunk))
    assert done.finish_reason == FINISH_LENGTH and drafter.finished_fraction([req.group_id])[0] == 0.0
    rest = GenRequest("c1", req.group_id, req.prompt_ids + list(done.token_ids), SamplingSpec(max_tokens=10_000),
                      sample_index=req.sample_index)
    run_virtual(inst.generate(rest))
    assert drafter.finished_fraction([req.group_id, "p1", "nope"]).tolist() == [0.5, 0.0, 0.0]
    caps = draft_caps(8, 2, 12, drafter.finished_fraction([req.group_id, "p1"]), 3.0)
    assert caps[0] > caps[1]


# -- prefix caching -------------------------------------------------------------------------------
def _chunked(tr, row, m):
    """The first chunk (m tokens) of trace row ``row`` and its continuation."""
    req = _requests(tr)[row]
    first = GenRequest(f"{req.request_id}-a", req.group_id, req.prompt_ids, SamplingSpec(max_tokens=m),
                       sample_index=req.sample_index)
    rest = GenRequest(f"{req.request_id}-b", req.group_id, req.prompt_ids + tr.response(row)[:m].tolist(),
                      SamplingSpec(max_tokens=10_000), sample_index=req.sample_index)
    return first, rest


def test_continuation_on_the_same_instance_hits_the_prefix_cache():
    tr = _trace(groups=1, samples=2, lo=250, hi=300, seed=2)
    src = TraceSource(tr)
    first, rest = _chunked(tr, 0, 100)
    ctx = len(rest.prompt_ids)

    def run(where: str, caching: bool = True):
        a, b = SimInstance("a", _cost(), src, prefix_caching=caching), SimInstance("b", _cost(), src)

        async def main():
            one = await a.generate(first)
            assert one.finish_reason == FINISH_LENGTH and len(one.token_ids) == 100
            second = a if where == "same" else b
            t1, before = asyncio.get_running_loop().time(), second.prefill_tokens
            two = await second.generate(rest)
            assert list(one.token_ids) + list(two.token_ids) == tr.response(0).tolist()
            return second.prefill_tokens - before, asyncio.get_running_loop().time() - t1

        return (*run_virtual(main()), a)

    same, t_same, a = run("same")
    other, t_other, a2 = run("other")
    off, t_off, a3 = run("same", caching=False)
    hit = (ctx - 1) // 16 * 16  # whole blocks, and the last token is always computed
    assert same == ctx - hit and a.prefix_hit_tokens == hit > 0
    assert other == ctx and a2.prefix_hit_tokens == 0 and a2.prefix_cached_tokens == ctx  # chunk 1 stays cached on a
    assert off == ctx and a3.prefix_hit_tokens == 0 and a3.prefix_cached_tokens == 0
    assert t_same < t_other == pytest.approx(t_off)
    assert a.prefill_tokens == len(first.prompt_ids) + ctx - hit
    assert a.prefix_cached_tokens == len(first.prompt_ids) + len(tr.response(0)) and a._kv == 0


def test_prefix_cache_is_evicted_under_kv_pressure():
    tr = _trace(groups=4, samples=2, lo=150, hi=200, seed=5)
    src = TraceSource(tr)
    first, rest = _chunked(tr, 0, 100)
    others = _requests(tr)[2:]
    need = sum(len(r.prompt_ids) + len(tr.response(i + 2)) for i, r in enumerate(others))
    cost = _cost(cap=need // 2 + 300)  # the others alone fill the cache

    def run(fill: bool):
        inst = _Checked("a", cost, src)

        async def main():
            await inst.generate(first)
            if fill:
                await asyncio.gather(*(inst.generate(r) for r in others))
            await inst.generate(rest)

        run_virtual(main())
        return inst

    kept, evicted = run(False), run(True)
    assert kept.prefix_hit_tokens > 0 and kept.prefix_evicted_tokens == 0
    assert evicted.prefix_hit_tokens == 0 and evicted.prefix_evicted_tokens >= len(rest.prompt_ids)
    prompts = sum(len(r.prompt_ids) for r in (first, rest, *others))
    assert kept.prefill_tokens == len(first.prompt_ids) + len(rest.prompt_ids) - kept.prefix_hit_tokens
    assert evicted.prefill_tokens >= prompts and (evicted.prefill_tokens == prompts or evicted.preemptions > 0)


def test_batched_split_equals_per_request_split():
    rng = np.random.default_rng(1)
    B, W = 7, 40
    d = rng.integers(0, 9, (B, W))
    e = np.minimum(d + 1, rng.integers(1, 10, (B, W)))
    caps = np.array([0, 1, 2, 3, 5, 8, 9])
    E, D, step, piece, pieces = split_schedules(e, d, caps)
    n = E.shape[1]
    assert n == pieces.min() and step.shape == piece.shape == (B, n + 1)
    for i in range(B):
        pe, pd, st, pc = split_schedule(e[i], d[i], int(caps[i]))
        assert pieces[i] == len(pe)
        assert (E[i] == pe[:n]).all() and (D[i] == pd[:n]).all()
        m = min(n + 1, len(pe))
        assert (step[i, :m] == st[:m]).all() and (piece[i, :m] == pc[:m]).all()
