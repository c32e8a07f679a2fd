"""verl_ext is inert where it is not selected (issue 47): installed, it must not change or break
veRL runs and vLLM engines that do not use it, even when its native extension cannot load.

Every check runs in fresh processes with ``tests/isa/no_suffix`` on ``PYTHONPATH``: its
``sitecustomize`` makes ``verl_ext.spec._suffix`` unimportable in every process of the run (Ray's
workers and vLLM's engine processes inherit the environment) and writes each attempt to import it,
with its stack, to ``$VERL_EXT_TEST_IMPORT_LOG``. A run that does not select verl_ext must train or
serve as plain veRL and vLLM, with no attempt logged.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _env(log: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "isa" / "no_suffix"), env.get("PYTHONPATH")]))
    env["VERL_EXT_TEST_IMPORT_LOG"] = str(log)
    return env


def _attempts(log: Path) -> str:
    return log.read_text() if log.is_file() else ""


def test_the_blocker_blocks(tmp_path):
    """The premise: under the blocker, the extension cannot be imported, and the attempt is logged."""
    log = tmp_path / "imports.log"
    proc = subprocess.run([sys.executable, "-c", "import verl_ext.spec._suffix"], env=_env(log), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "made unimportable" in proc.stderr
    assert "verl_ext.spec._suffix" in _attempts(log)


def test_a_vllm_engine_serves_plain_requests_without_verl_ext_code(tmp_path, model_dir):
    """verl_ext's vLLM plugin loads in the engine's processes (it must: keyed requests may come),
    but it loads no native code, and without a keyed request the engine runs none of verl_ext's
    step hooks: ``engine_info`` says keyed sampling is ready, not active."""
    log = tmp_path / "imports.log"
    code = textwrap.dedent(f"""
        import asyncio, json
        from verl_ext.engine.instance import GenRequest, SamplingSpec
        from verl_ext.vllm.local import VLLMInstanceFactory

        async def main():
            (inst,) = await VLLMInstanceFactory({str(model_dir)!r}, max_model_len=256, max_num_seqs=4,
                                                extra_engine_args={{"dtype": "float32"}}).create(1)
            try:
                greedy = SamplingSpec(temperature=0.0, max_tokens=8)
                sampled = SamplingSpec(temperature=1.0, max_tokens=8, seed=3)  # seeded, not keyed
                done = await asyncio.gather(inst.generate(GenRequest("a", "g", [1, 2, 3], greedy)),
                                            inst.generate(GenRequest("b", "g", [1, 2, 3], sampled)))
                info = await inst.engine_report()
                print("RESULT", json.dumps({{"tokens": [len(c.token_ids) for c in done], "info": info}}))
            finally:
                await inst.shutdown()

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    script = tmp_path / "serve.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env=_env(log), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert got["tokens"] == [8, 8]
    assert got["info"]["plugin"]["installed"] and got["info"]["keyed_sampling"] == {
        "ready": True, "active": False, "rule": got["info"]["keyed_sampling"]["rule"]}
    assert _attempts(log) == ""


def test_plain_verl_trains_on_cpu_with_the_extension_unimportable(tmp_path, model_dir):
    """``python -m verl.trainer.main_ppo trainer.device=cpu ...`` without ``rollout=<strategy>``:
    veRL's own agent-loop manager, verl_ext's plugin in every process (the CPU mode, the config
    check, the preset's KV size) and no native code of verl_ext anywhere; one GRPO step."""
    from verl_ext.verl_runs.e2e import trainer_command
    from verl_ext.workload.verl_data import write_dataset

    log = tmp_path / "imports.log"
    data = tmp_path / "data"
    write_dataset(data, train=2, val=2)
    cmd = [a for a in trainer_command("baseline", data, str(model_dir), steps=1, prompts=2, n=2, max_tokens=16,
                                      temperature=1.0) if not a.startswith("rollout=")]
    cmd += ["trainer.logger=[console,file]", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
    env = _env(log)
    env["VERL_FILE_LOGGER_ROOT"] = str(tmp_path / "logger")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for p in (tmp_path / "logger").rglob("*.jsonl") for line in p.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert not any(k.startswith("verl_ext/") for k in rows[0]["data"])  # veRL's own manager rolled out
    assert _attempts(log) == ""
