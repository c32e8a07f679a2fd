"""Both x86 ISAs vllm-cpu ships kernels for (issue 47): AVX-512 machines load ``vllm/_C`` (or
``_C_AVX512``), AVX2 machines ``vllm/_C_AVX2``, and keyed sampling must run on each with vLLM's
own loaded kernels. The rest of the suite runs this machine's build; here ``tests/isa/avx2`` (on
``PYTHONPATH``) makes vLLM's platform load the AVX2 build in every process, as on an AVX2-only
CPU (an AVX-512 CPU runs AVX2 code), and ``ATEN_CPU_CAPABILITY=avx2`` keeps torch's kernels to
AVX2. Before the fix, the keyed rule's own ``import vllm._C`` loaded a second kernel library
there and aborted the engine on its first keyed step. On an AVX2-only machine the whole suite
runs the AVX2 build, so this test skips there and ``test_ab_cli``'s keyed run at temperature 0.7
checks the kernel library and keyed rule each of its engines reports."""

import json
import os
import platform
import sys
from pathlib import Path

import pytest
from _util import KERNELS, run_command

pytest.importorskip("vllm")


def _native_isa():
    from verl_ext.vllm.machine import vllm_cpu_isa

    return vllm_cpu_isa()


pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu's ISA builds are x86's"),
              # an AVX2-only machine runs the AVX2 build in every test: there test_ab_cli's keyed
              # run (test_ab_keyed_samples_with_drafting_on_and_off) checks its engines' kernels and rule
              pytest.mark.skipif(_native_isa() == "avx2", reason="this machine's own build is the AVX2 one")]

TESTS = Path(__file__).resolve().parent


def avx2_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS / "isa" / "avx2"), env.get("PYTHONPATH")]))
    env["ATEN_CPU_CAPABILITY"] = "avx2"
    return env


def test_keyed_strategies_on_the_avx2_build_give_baselines_tokens(tmp_path):
    """The issue's command: a chunking strategy at temperature 1 with keyed sampling, every
    response identical to baseline's, and each engine reports the AVX2 library and vLLM's fused
    op as the rule it ran."""
    out = tmp_path / "ab"
    cmd = [sys.executable, "-m", "verl_ext.cli", "ab", "--strategies", "baseline,seer[chunk_size=16]",
           "--temperature", "1", "--keyed-sampling", "--require-identical", "--dtype", "float32", "--prompts", "4",
           "--samples", "2", "--max-tokens", "64", "--instances", "1", "--no-progress", "--out", str(out),
           "--engine-log", str(tmp_path / "engines.log")]
    proc = run_command(cmd, timeout=900, env=avx2_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "seer[chunk_size=16]: 8/8 responses token-identical to baseline's" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    for name, metrics in summary["strategies"].items():
        (engine,) = metrics["engines"]
        assert engine["vllm_kernels"] == KERNELS["avx2"] and engine["vllm_cpu_isa"] == "avx2", name
        assert engine["keyed_sampling"] == {"ready": True, "active": True, "rule": "vllm-fused-op"}, name
    assert summary["strategies"]["seer[chunk_size=16]"]["mechanisms"]["chunk_continuations"] > 0
