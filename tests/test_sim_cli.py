"""`verl-ext sim` end to end (committed trace and a small synthetic workload) and its bad
input: each gets one error line naming the problem, exit code 2, and no outputs."""

import json
from pathlib import Path

import numpy as np
import pytest

from verl_ext.compare.metrics import REQUIRED_FIELDS, SCHEMA
from verl_ext.cli import main
from verl_ext.trace.format import read_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "smollm2_arith_e2.parquet"


def test_sim_ab_on_the_committed_trace(tmp_path, capsys):
    out = tmp_path / "ab"
    arms = "baseline,baseline+spec:request+history,oracle"
    rc = main(["sim", "--trace", str(TRACE), "--preset", "cpu-smollm2", "--instances", "2",
               "--strategies", arms, "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "summary.json").read_text())
    assert s["schema"] == SCHEMA and s["kind"] == "sim" and list(s["strategies"]) == arms.split(",")
    tr = read_trace(TRACE)
    last = tr.epoch == tr.epochs()[-1]
    for name, m in s["strategies"].items():
        assert all(m[f] is not None for f in REQUIRED_FIELDS), name
        assert m["requests"] == int(last.sum())
        assert m["output_tokens"] == int(tr.response_lengths()[last].sum())  # nothing lost, nothing made up
        assert m["mean_reward"] == pytest.approx(float(np.nanmean(tr.reward[last])), abs=1e-6)
    spec = s["strategies"]["baseline+spec:request+history"]
    assert spec["draft_tokens"] > 0 and spec["tokens_per_step"] > 1.0
    assert s["strategies"]["oracle"]["vs_oracle"] == pytest.approx(1.0)
    for f in ("report.md", "kv_running.png", "completion_cdf.png", "acceptance.png", "requests.jsonl"):
        assert (out / f).stat().st_size > 0, f
    assert "| oracle |" in (out / "report.md").read_text()


#: metrics that time this host, not the simulated cluster: they differ between runs
HOST_TIMES = {"sim_seconds", "strategy/decision_s", "strategy/bon_decision_s", "strategy/history_serve_s"}


def _simulated(arms: dict) -> dict:
    """Each arm's metrics without its host timings (``HOST_TIMES``)."""
    return {name: {k: v for k, v in m.items() if k not in HOST_TIMES} for name, m in arms.items()}


def test_arms_in_worker_processes_give_the_figures_of_one_process(tmp_path, capsys):
    """``--jobs 2`` runs the arms in two forked workers: every simulated figure, the records and
    the report's timeline plots are those of ``--jobs 1``, arm for arm and in the order given."""
    arms = "rlhfspec,baseline,rhyme"
    got = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        rc = main(["sim", "--trace", str(TRACE), "--preset", "cpu-smollm2", "--instances", "2", "--strategies", arms,
                   "--jobs", jobs, "--out", str(out), "--no-progress"])
        assert rc == 0, capsys.readouterr().err
        got[jobs] = json.loads((out / "summary.json").read_text())
        assert list(got[jobs]["strategies"]) == arms.split(",")
        assert (out / "kv_running.png").stat().st_size > 0 and (out / "acceptance.png").stat().st_size > 0
    one, two = (got[j]["strategies"] for j in ("1", "2"))
    assert one["rlhfspec"]["draft_tokens"] > 0 and one["rlhfspec"]["mechanisms"]["selection_steps"] > 0
    assert _simulated(one) == _simulated(two)
    read = lambda j: sorted((tmp_path / f"jobs{j}" / "requests.jsonl").read_text().splitlines())  # noqa: E731
    assert read("1") == read("2")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--jobs", "0"], "--jobs must be >= 1")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--jobs", "2", "--pipeline", "sync"], "--pipeline's arms")


def test_sim_ab_default_scenario_shape(tmp_path):
    """The synthetic workload path of the default scenario, shrunk by flags."""
    out = tmp_path / "ab"
    rc = main(["sim", "--strategies", "baseline,oracle", "--prompts", "16", "--samples", "4",
               "--mean-len", "256", "--max-len", "1024", "--instances", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"]["source"] == "synthetic" and s["workload"]["requests"] == 64
    assert s["config"]["cost_model"]["name"] == "h100-7b"
    b, o = s["strategies"]["baseline"], s["strategies"]["oracle"]
    assert b["output_tokens"] == o["output_tokens"] == s["workload"]["response_tokens"]


def _bad(tmp_path, capsys, argv, match):
    out = tmp_path / "bad"
    rc = main(["sim", "--out", str(out), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert match in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "summary.json").exists()


def test_sim_bad_input(tmp_path, capsys):
    _bad(tmp_path, capsys, ["--instances", "0"], "--instances must be >= 1")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    _bad(tmp_path, capsys, ["--trace", str(corrupt)], "corrupt.parquet")
    _bad(tmp_path, capsys, ["--trace", str(tmp_path / "missing.parquet")], "missing.parquet")
    preset = json.loads(Path(__file__).resolve().parents[1].joinpath("verl_ext/perf/presets/h100-7b.json").read_text())
    del preset["kv_capacity_tokens"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(preset))
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--preset", str(broken)], "kv_capacity_tokens")
    _bad(tmp_path, capsys, ["--preset", "h999-1b"], "h100-7b")  # unknown preset lists the known ones
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--model", "x"], "--model is for real engines")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--prompts", "4"], "not with --trace")
    _bad(tmp_path, capsys, ["--similarity", "wild", "--prompts", "4", "--samples", "2", "--mean-len", "64"], "similarity")
    _bad(tmp_path, capsys, ["--synth-knobs", '{"bogus": 1}'], "shared_path")  # names the knobs it takes
    _bad(tmp_path, capsys, ["--synth-knobs", "{nope"], "not JSON")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--synth-knobs", '{"shared_path": 1}'], "--synth-knobs shape")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--epoch", "7"], "epoch 7")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--strategies", "nope"], "unknown rollout strategy")
    _bad(tmp_path, capsys, ["--trace", str(TRACE), "--replay", "psychic", "--strategies", "baseline+spec"], "replay mode")


def test_synth_knobs_reach_the_simulated_workload(tmp_path):
    """``--synth-knobs`` replaces the similarity level's content knobs: the run's workload is the
    one ``synthesize`` makes with them (its tokens differ from the level's own)."""
    from verl_ext.sim.runner import SimConfig
    from verl_ext.sim.workload import load_workload

    shape = ["--similarity", "published", "--prompts", "4", "--samples", "2", "--mean-len", "128", "--max-len", "512",
             "--instances", "1", "--strategies", "baseline"]
    knobs = {"shared_path": 1.0, "self_from_history": 1.0}
    for name, extra in (("level", []), ("tied", ["--synth-knobs", json.dumps(knobs)])):
        assert main(["sim", "--out", str(tmp_path / name), "--no-progress", *shape, *extra]) == 0
    synth = {"prompts": 4, "samples": 2, "mean_len": 128, "max_len": 512}
    level = load_workload(SimConfig(synth=synth, similarity="published"))
    tied = load_workload(SimConfig(synth={**synth, **knobs}, similarity="published"))
    assert level.response_tokens.tobytes() != tied.response_tokens.tobytes()
    assert tied.meta["synth"]["config"]["shared_path"] == 1.0 and level.meta["synth"]["config"]["shared_path"] == 0.0
    runs = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in ("level", "tied")}
    assert runs["tied"]["config"]["synth"] == {**synth, **knobs} and "shared_path" not in runs["level"]["config"]["synth"]


def test_profile_from_trace_fits_the_committed_trace(tmp_path, capsys):
    """`verl-ext fit trace`: step times read back from a real trace's token times."""
    from verl_ext.perf.cost import load_cost_model
    from verl_ext.measure.trace import trace_windows

    tr = read_trace(TRACE)
    w = trace_windows(tr, epochs=[0])
    assert sum(x["steps"] for x in w) >= 384  # at least the longest response's steps per instance
    assert all(x["time_s"] > 0 and x["batch"] >= 1 for x in w)
    assert sum(x["prefill_tokens"] for x in w) == int(tr.prompt_lengths()[tr.epoch == 0].sum())  # every prompt once
    out = tmp_path / "fit.json"
    assert main(["fit", "trace", f"{TRACE}@0", "--base", "cpu-smollm2", "--out", str(out)]) == 0
    cm = load_cost_model(str(out))
    assert cm.token_s > 0 and cm.kv_capacity_tokens == load_cost_model("cpu-smollm2").kv_capacity_tokens
    fit = json.loads(out.read_text())["fit"]
    assert abs(fit["total_time_error"]) < 0.15
    assert main(["fit", "trace", f"{TRACE}@9", "--base", "cpu-smollm2", "--out", str(out)]) == 2
    assert "epoch '9' is not in the trace" in capsys.readouterr().err
    assert main(["profile", "--from-trace", str(TRACE), "--out", str(out)]) == 2
    assert "needs --base" in capsys.readouterr().err


def test_each_command_shows_its_own_flags_and_the_old_spelling_still_works(tmp_path, capsys):
    assert main(["sim", "--help"]) == 0
    sim_help = capsys.readouterr().out
    assert main(["ab", "--help"]) == 0
    ab_help = capsys.readouterr().out
    assert "--pipeline" in sim_help and "--model" not in sim_help and "--require-identical" not in sim_help
    assert "--require-identical" in ab_help and "--pipeline" not in ab_help and "--sim" not in ab_help
    # `ab --sim` (the old spelling) runs `sim`, after a note
    assert main(["ab", "--sim", "--instances", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "deprecated; use `verl-ext sim`" in err[0] and "--instances must be >= 1" in err[1]
    assert main(["profile", "--thresholds", "h100-7b"]) == 0
    captured = capsys.readouterr()
    assert "use `verl-ext fit thresholds`" in captured.err and captured.out.startswith("h100-7b: draft thresholds")


def test_bench_sim_vs_real_simulates_each_verl_step_from_its_runs_own_trace(tmp_path):
    """``scripts/bench_sim_vs_real.py --verl``: each strategy's ``verl_e2e.sh --trace`` run is
    simulated step by step from its own traces (steps before: history and warm engines), and
    its ratio to ``baseline`` is the median over steps of each side's per-step quotient. The
    runs here are slices of the committed trace, laid out as the trace hook and verl_e2e write
    them, with rollout times chosen so that the real quotients are known."""
    import subprocess
    import sys

    from verl_ext.sim.runner import SimConfig, run_sim_ab
    from verl_ext.trace.format import write_trace

    repo = Path(__file__).resolve().parent.parent
    full = read_trace(repo / "data" / "traces" / "smollm2_arith_e2.parquet")
    uids = sorted(set(full.prompt_uid.tolist()))
    real = {"baseline": [9.0, 8.0], "rhyme": [9.5, 6.0]}
    for name, prompts in (("baseline", uids[:3]), ("rhyme", uids[3:6])):
        run = tmp_path / "verl" / name
        (run / "traces").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"rollout_s": real[name]}))
        (run / "command.txt").write_text(f"python -m verl.trainer.main_ppo rollout={name} trainer.n_gpus_per_node=2")
        for e in (0, 1):
            step = full.select(np.isin(full.prompt_uid, prompts) & (full.epoch == e) & (full.sample_index < 4))
            step.epoch[:] = e + 1  # the hook's epoch is the training step
            step.meta.update(response_length=256, temperature=1.0)
            write_trace(step, run / "traces" / f"step_{e + 1}.parquet")
    r = subprocess.run([sys.executable, str(repo / "scripts" / "bench_sim_vs_real.py"), "--json", "--no-ab",
                        "--verl", str(tmp_path / "verl"), "--strategies", "baseline,rhyme", "--out", str(tmp_path / "svr")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    rows = {row["strategy"]: row for row in got["rows"]}
    assert set(rows) == {"baseline", "rhyme"} and all(row["path"] == "verl" and row["steps"] == [2] for row in rows.values())
    assert "ab" in got["not_run"] and got["verl"]["runs"]["rhyme"]["servers"] == 2
    assert rows["rhyme"]["real_ratio"] == round(6.0 / 8.0, 4) and rows["rhyme"]["band"] == 0.15
    # each step's prediction is what `verl-ext sim` gives for that run's trace at that step
    sim = {name: run_sim_ab(SimConfig(strategies=[name], trace=got["verl"]["runs"][name]["trace"], preset="cpu-smollm2-avx2",
                                      instances=2, epoch=2, max_tokens=256, warm_epochs=True, out=str(tmp_path / name)),
                            progress=False)["strategies"][name]["wall_s"] for name in real}
    assert rows["rhyme"]["sim_rollout_s"] == [round(sim["rhyme"], 3)] and rows["baseline"]["sim_rollout_s"] == [round(sim["baseline"], 3)]
    assert rows["rhyme"]["sim_ratio"] == round(sim["rhyme"] / sim["baseline"], 4)
    assert rows["rhyme"]["error"] == round(rows["rhyme"]["sim_ratio"] / rows["rhyme"]["real_ratio"] - 1, 4)
    assert rows["baseline"]["wall_error"] == round(sim["baseline"] / 8.0 - 1, 4)
