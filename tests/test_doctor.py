"""``verl-ext doctor`` (issue 47): what verl_ext sees on this machine, and a non-zero exit where
something it needs is broken."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

TESTS = Path(__file__).resolve().parent


def test_doctor_reports_the_machine_the_extension_and_every_hook_point():
    from verl_ext.cli.doctor import report
    from verl_ext.vllm.machine import cpu_isa
    from verl_ext.cli.doctor import all_hooks
    from verl_ext.cpu import shim
    from verl_ext.rollout import v1_metrics
    from verl_ext.vllm import hooks

    r = report()
    assert r["problems"] == [] and r["native_extension"]["loads"]
    assert r["machine"]["cpu_isa"] == cpu_isa() and r["machine"]["vllm_cpu_sees_gib"]["total"] > 0
    assert [f"{h['module']}:{h['attribute']}" for h in r["hooks"]] == [h.target for h in all_hooks()]
    # each table lists what its own module installs
    for table, module in ((hooks.HOOKS, hooks), (shim.HOOKS, shim), (v1_metrics.HOOKS, v1_metrics)):
        assert table and all(h.installer.startswith(module.__name__ + ".") for h in table)
    assert all(h["present"] for h in r["hooks"])


def test_doctor_exits_1_and_says_why_when_the_extension_does_not_load(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "isa" / "no_suffix"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "verl_ext.cli", "doctor", "--json"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["native_extension"]["loads"] is False and "made unimportable" in r["native_extension"]["error"]
    assert r["problems"] == ["verl_ext's native extension does not load"]


def test_the_other_commands_point_to_doctor_when_verl_ext_cannot_load():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "isa" / "no_suffix"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "verl_ext.cli", "ab"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("verl-ext: cannot load its commands (ImportError:")
    assert "run `verl-ext doctor`" in proc.stderr
