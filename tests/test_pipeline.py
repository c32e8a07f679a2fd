"""Consecutive training steps in the simulator (``verl_ext.sim.pipeline``): the dependencies of
each mode, instances moving on per step in ``stream`` mode, HistoPipe's alternation across steps,
and the CLI."""

import json

import numpy as np
import pytest
from test_rhyme import _two_epoch_trace, repeating_trace
from test_sim import _cost

from verl_ext.cli import main
from verl_ext.sim.pipeline import _ROUTE_S, MODES, arm_mode, run_pipeline_arm, split_steps
from verl_ext.sim.runner import SimConfig, select_epoch

T_TRAIN = 0.4


def _arm(label, mode, steps=4, instances=4, groups=16, t_train=T_TRAIN):
    tr = _two_epoch_trace(groups=groups, samples=4, outlier=("p3", 1, 900))
    _, rows, history = select_epoch(tr, 1)
    batches = split_steps(tr.prompt_uid, rows, steps, seed=0)
    cfg = SimConfig(instances=instances, spec_k=8)
    return tr, rows, run_pipeline_arm(label, cfg, _cost(), tr, rows, history, batches, 2000, mode, t_train)


def test_split_steps_whole_prompts_every_row_once():
    tr = _two_epoch_trace(groups=10, samples=3)
    _, rows, _ = select_epoch(tr, 1)
    batches = split_steps(tr.prompt_uid, rows, 4, seed=3)
    assert sorted(np.concatenate(batches).tolist()) == sorted(rows.tolist())
    uids = [set(tr.prompt_uid[b].tolist()) for b in batches]
    assert [len(u) for u in uids] == [3, 3, 2, 2] and len(set().union(*uids)) == 10  # disjoint, whole prompts
    assert all(len(b) == 3 * len(u) for b, u in zip(batches, uids))
    again = split_steps(tr.prompt_uid, rows, 4, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="more than the epoch's 10 prompts"):
        split_steps(tr.prompt_uid, rows, 11)


@pytest.mark.parametrize("mode", MODES)
def test_step_dependencies_of_each_mode(mode):
    tr, rows, r = _arm("baseline", mode)
    st = r.metrics["steps"]

    def train_end(k):
        return 0.0 if k < 1 else st[k - 1]["train_end_s"]

    def rollout_end(k):
        return 0.0 if k < 1 else st[k - 1]["rollout_end_s"]

    ids = [x["request_id"] for x in r.records]
    assert len(ids) == len(set(ids)) == len(rows)  # every sample exactly once
    assert r.metrics["output_tokens"] == int(tr.response_lengths()[rows].sum())
    for s, t in enumerate(st, start=1):
        # training on a step starts once its last sample is done and the previous training is
        assert t["train_start_s"] == pytest.approx(max(t["rollout_end_s"], train_end(s - 1)))
        assert t["train_end_s"] == pytest.approx(t["train_start_s"] + T_TRAIN)
        weights = {"sync": train_end(s - 1),  # on-policy: the previous step's weights
                   "one_step_off": max(rollout_end(s - 1), train_end(s - 2)),
                   "stream": train_end(s - 2)}[mode]
        assert t["dispatch_s"] == pytest.approx(weights)
        assert all(x["finish_s"] <= t["rollout_end_s"] for x in r.records if x["step"] == s)
    for (name, s), (start, end) in r.spans.items():
        prev = r.spans[(name, s - 1)][1] if s > 1 else 0.0
        assert start >= prev and end >= start
        if mode == "stream":  # an instance moves on as soon as it is done and the weights are there
            assert start == pytest.approx(max(st[s - 1]["dispatch_s"] + _ROUTE_S, prev), abs=1e-9)
        else:  # everyone starts the step together
            assert start == pytest.approx(st[s - 1]["dispatch_s"] + _ROUTE_S, abs=1e-9)
    if mode == "sync":
        rollouts = sum(t["rollout_end_s"] - t["dispatch_s"] for t in st)
        assert r.metrics["pipeline_s"] == pytest.approx(rollouts + len(st) * T_TRAIN, abs=1e-4)


def test_stream_overlaps_steps_and_beats_the_synchronous_loop():
    _, _, sync = _arm("baseline", "sync")
    _, _, stream = _arm("baseline", "stream")
    st = stream.metrics["steps"]
    early = min(a for (n, s), (a, b) in stream.spans.items() if s == 2)
    assert early < st[0]["rollout_end_s"]  # step 2 began while step 1's tail still ran
    assert stream.metrics["pipeline_s"] < sync.metrics["pipeline_s"]
    assert stream.metrics["bubble_fraction"] < sync.metrics["bubble_fraction"]


def test_histopipe_alternates_blocks_across_steps():
    """Ranked prompts: in every step the first instance serves the shortest ranking group on odd
    steps and the longest on even ones (each step plans from history, with its own strategy)."""
    tr, rows, r = _arm("rhyme[histospec=false,two_tier=false,migration=false,ranking_groups=4]", "stream")
    assert r.metrics["strategy/histopipe_active"] == 4.0
    hist = {f"p{g}": (g + 1) * 20 for g in range(16)}  # the trace's historical lengths by prompt
    for s in range(1, 5):
        recs = [x for x in r.records if x["step"] == s]
        first = np.mean([hist[x["group_id"]] for x in recs if x["instance"] == "sim-0"])
        rest = np.mean([hist[x["group_id"]] for x in recs if x["instance"] != "sim-0"])
        global_step = 1 + s  # epoch 1's steps follow the history's
        assert (first < rest) == (global_step % 2 == 1), (s, first, rest)


def test_histopipe_by_default_only_where_rollouts_overlap_training():
    """``histopipe=auto`` (the default): ranking groups in pipelines that overlap a step's rollout
    with training (``stream``), least-loaded dispatch in synchronous steps, where blocks lose to
    it; ``histopipe=true`` plans in synchronous steps too."""
    arm = "rhyme[histospec=false,two_tier=false,migration=false,ranking_groups=4]"
    _, _, stream = _arm(arm, "stream")
    _, _, sync = _arm(arm, "sync")
    _, _, forced = _arm(arm.replace("histospec=false", "histospec=false,histopipe=true"), "sync")
    assert stream.metrics["strategy/histopipe_active"] == 4.0
    assert sync.metrics["strategy/histopipe_active"] == 0.0 and sync.metrics["mechanisms"]["histopipe_placements"] == 0
    assert forced.metrics["strategy/histopipe_active"] == 4.0 and forced.metrics["mechanisms"]["histopipe_placements"] > 0


def test_history_drafts_are_loaded_per_step():
    """HistoSpec in the pipeline: each step's histories are in the drafter while it rolls out
    (responses that repeat their history exactly draft well)."""
    tr = repeating_trace(groups=8, samples=2, length=300, seed=2)
    _, rows, history = select_epoch(tr, 1)
    batches = split_steps(tr.prompt_uid, rows, 4, seed=0)
    r = run_pipeline_arm("rhyme[histopipe=false,batch_cutoff=false]", SimConfig(instances=2, spec_k=8), _cost(), tr,
                         rows, history, batches, 2000, "stream", T_TRAIN)
    assert r.metrics["output_tokens"] == 16 * 300
    assert r.metrics["tokens_per_step"] > 3.0 and r.metrics["draft_acceptance"] > 0.9
    # the pipeline reports rhyme's mechanisms as the single-rollout drivers do: every accepted
    # draft came from the history trees (HistoPipe is off here: no placements)
    mech = r.metrics["mechanisms"]
    assert set(mech) == {"history_draft_tokens_accepted", "histopipe_placements", "migrations"}
    assert mech["history_draft_tokens_accepted"] > 0 and mech["histopipe_placements"] == 0


def test_arm_modes():
    assert arm_mode("rhyme[two_tier=false]@sync", "stream") == ("rhyme[two_tier=false]", "sync")
    assert arm_mode("baseline", "stream") == ("baseline", "stream")
    with pytest.raises(ValueError, match="unknown pipeline mode 'later'"):
        arm_mode("baseline@later", "stream")


def test_pipeline_cli_writes_summary_report_and_requests(tmp_path, capsys):
    out = tmp_path / "pipe"
    rc = main(["sim", "--pipeline", "stream", "--steps", "4", "--t-train", "2", "--strategies",
               "baseline,rhyme@sync", "--prompts", "16", "--samples", "4", "--mean-len", "256", "--max-len", "1024",
               "--instances", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "baseline@stream" in printed and "vs sync baseline" in printed
    s = json.loads((out / "summary.json").read_text())
    assert s["kind"] == "sim_pipeline" and s["config"]["t_train_s"] == 2.0
    assert list(s["strategies"]) == ["baseline@sync", "baseline@stream", "rhyme@sync"]
    assert s["strategies"]["baseline@sync"]["vs_baseline_sync"] == 1.0
    for m in s["strategies"].values():
        assert m["output_tokens"] == s["workload"]["response_tokens"] and len(m["steps"]) == 4
    assert (out / "report.md").exists() and (out / "steps.png").stat().st_size > 0
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert {x["step"] for x in recs} == {1, 2, 3, 4}
    for arm in ("baseline@sync", "baseline@stream"):  # rhyme's migrations add continuation records
        assert sum(x["strategy"] == arm for x in recs) == s["workload"]["requests"]


def _bad(tmp_path, capsys, argv, match, command="sim"):
    rc = main([command, "--out", str(tmp_path / "bad"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_pipeline_bad_input(tmp_path, capsys):
    small = ["--prompts", "8", "--samples", "2", "--mean-len", "64", "--max-len", "256"]
    _bad(tmp_path, capsys, [*small, "--steps", "2"], "--steps/--t-train need --pipeline")
    _bad(tmp_path, capsys, [*small, "--pipeline", "later"], "unknown --pipeline mode 'later'")
    _bad(tmp_path, capsys, [*small, "--pipeline", "stream", "--steps", "0"], "--steps must be >= 1")
    _bad(tmp_path, capsys, [*small, "--pipeline", "stream", "--t-train", "-1"], "--t-train must be")
    _bad(tmp_path, capsys, [*small, "--pipeline", "sync", "--strategies", "baseline@later"], "unknown pipeline mode")
    _bad(tmp_path, capsys, [*small, "--pipeline", "sync", "--steps", "9"], "more than the epoch's 8 prompts")
    _bad(tmp_path, capsys, ["--pipeline", "stream"], "--pipeline needs --sim", command="ab")


# -- inter-step migration (RhymeRL 6.3; verl_ext.pipe.defer) ---------------------------------------
_INTER = "rhyme[histospec=false,inter_step=true]"


def _outlier_arm(label, mode, step, rank, length=1500):
    """The pipeline over a trace whose ``rank``-th shortest prompt of step ``step`` (1-based; -1 =
    longest) has one outlier response of ``length`` tokens; returns (trace, rows, uid, result)."""
    base = _two_epoch_trace(groups=16, samples=4)
    _, rows, _ = select_epoch(base, 1)
    batch = split_steps(base.prompt_uid, rows, 4, seed=0)[step - 1]
    uid = sorted(set(base.prompt_uid[batch].tolist()), key=lambda u: int(u[1:]))[rank]
    tr = _two_epoch_trace(groups=16, samples=4, outlier=(uid, 1, length))
    _, rows, history = select_epoch(tr, 1)
    batches = split_steps(tr.prompt_uid, rows, 4, seed=0)
    r = run_pipeline_arm(label, SimConfig(instances=4, spec_k=8), _cost(), tr, rows, history, batches, 2000, mode,
                         T_TRAIN, keep_completions=True)
    return tr, rows, uid, r


@pytest.mark.parametrize("mode", ["one_step_off", "stream"])
def test_inter_step_migration_defers_a_long_groups_outlier_to_the_next_step(mode):
    tr, rows, uid, r = _outlier_arm(_INTER, mode, step=1, rank=-1)
    m, st = r.metrics, r.metrics["steps"]
    assert m["strategy/deferrals"] == 1 and m["strategy/migrations"] == 0
    # its whole group (4 samples) trains with step 2; every sample is trained exactly once
    assert m["deferred_samples"] == 4
    assert [t["trained_samples"] for t in st] == [12, 20, 16, 16]
    assert [(t["deferred_out"], t["deferred_in"]) for t in st] == [(1, 0), (0, 1), (0, 0), (0, 0)]
    trained = [c for comps in r.completions for c in comps]
    assert sorted(c.request_id for c in trained) == sorted({x["request_id"] for x in r.records})
    assert len(trained) == len(rows) and m["output_tokens"] == int(tr.response_lengths()[rows].sum())
    # the outlier's tokens are the trace's response, whole and in order, across the two steps
    (row,) = [i for i in rows if tr.prompt_uid[i] == uid and tr.sample_index[i] == 1]
    (out,) = [c for c in r.completions[1] if c.token_ids and len(c.token_ids) == 1500]
    assert list(out.token_ids) == tr.response(row).tolist() and out.finish_reason == "stop"
    recs = sorted((x for x in r.records if x["request_id"] == out.request_id), key=lambda x: x["submit_s"])
    assert [x["step"] for x in recs][-1] == 2 and {x["step"] for x in recs} == {1, 2}
    assert sum(x["output_tokens"] for x in recs) == 1500
    # step 1 rolled out (and trained) without waiting for it; it resumed once step 2 was dispatched
    assert st[0]["rollout_end_s"] < recs[-1]["finish_s"]
    assert recs[-1]["submit_s"] >= st[1]["dispatch_s"]
    assert all(x["finish_s"] <= st[1]["rollout_end_s"] for x in recs)
    # and the pipeline is faster than with the outlier migrated within step 1
    _, _, _, intra = _outlier_arm("rhyme[histospec=false]", mode, step=1, rank=-1)
    assert intra.metrics["strategy/migrations"] == 1 and intra.metrics["deferred_samples"] == 0
    assert m["pipeline_s"] < intra.metrics["pipeline_s"]


def test_inter_step_migration_keeps_short_groups_and_the_last_step_within_the_step():
    """The paper migrates outliers of short ranking groups within the step; the epoch's last step
    has no next step to defer to."""
    for step, rank in ((1, 0), (4, -1)):
        _, _, _, r = _outlier_arm(_INTER, "stream", step=step, rank=rank)
        assert r.metrics["strategy/deferrals"] == 0 and r.metrics["strategy/migrations"] == 1, (step, rank)
        assert r.metrics["deferred_samples"] == 0


def test_inter_step_migration_is_refused_where_nothing_carries_it(tmp_path, capsys):
    from verl_ext.pipe.arms import make_arm
    from verl_ext.config.settings import VerlExtSettings
    from verl_ext.pipe.strategy import StrategyConfigError

    with pytest.raises(StrategyConfigError, match="on-policy `sync` pipeline"):
        _outlier_arm(_INTER, "sync", step=1, rank=-1)
    with pytest.raises(StrategyConfigError, match="a single rollout"):
        make_arm(_INTER)
    inter = {"verl_ext": {"strategy": "rhyme", "options": {"inter_step": True}}}
    with pytest.raises(StrategyConfigError, match="synchronous and one-step-off-policy trainers"):
        VerlExtSettings.from_custom(inter)
    assert VerlExtSettings.from_custom(inter, async_trainer=True).options == {"inter_step": True}  # veRL's async trainers
    with pytest.raises(StrategyConfigError, match="needs histopipe=true or auto and migration=true"):
        make_arm("rhyme[inter_step=true,migration=false]", carrier=None)
    _bad(tmp_path, capsys, ["--prompts", "8", "--samples", "2", "--mean-len", "64", "--max-len", "256",
                            "--strategies", _INTER], "a single rollout")
