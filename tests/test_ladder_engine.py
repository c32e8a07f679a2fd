"""The draft ladder measured on the engine (SpecActor section 4.2, ``verl_ext.measure.engine_ladder``):
drafts of a known continuation accepted at a set rate, the measured tables, and one real run."""

import math
import numpy as np
import pytest

from _util import ProposerBatch, make_proposer
from verl_ext.spec.ladder import DraftLadder, DraftMethod, LadderError
from verl_ext.measure.engine_ladder import EngineLadder, ladder_from, measure
from verl_ext.spec.reference import ReferenceDraft


def _accepted_prefix(draft, true):
    n = 0
    for d, t in zip(draft, true):
        if d != t:
            break
        n += 1
    return n


def test_reference_drafts_are_accepted_at_the_set_rate():
    cont = np.arange(1, 400)
    exact = ReferenceDraft(cont, prompt_len=10, accept=1.0)
    assert exact.draft(10, 4) == [1, 2, 3, 4] and exact.draft(15, 3) == [6, 7, 8]
    assert exact.draft(10 + 397, 4) == [398, 399] and exact.draft(10 + 399, 4) == []  # never past its end
    assert all(d != t for d, t in zip(ReferenceDraft(cont, 10, 0.0).draft(10, 8), cont))
    assert ReferenceDraft([0, 5], 0, 0.0).draft(0, 2) == [1, 4]  # a replaced token is another valid id
    # the accepted prefix of a w-token draft is that of a verifier accepting each token with
    # probability p: E = p + p^2 + ... + p^w (verl_ext.spec.tgs)
    for p, w in ((0.6, 8), (0.3, 4), (0.9, 2)):
        ref = ReferenceDraft(cont, 0, p, seed=1)
        mean = np.mean([_accepted_prefix(ref.draft(5, w), cont[5: 5 + w]) for _ in range(20000)])
        assert mean == pytest.approx(sum(p ** i for i in range(1, w + 1)), rel=0.03)
    assert ReferenceDraft.from_ident({}, "r", 3) is None
    assert ReferenceDraft.from_ident({"spec_reference": [1, 2], "spec_accept": "x"}, "r", 3) is None
    a = ReferenceDraft.from_ident({"spec_reference": list(cont), "spec_accept": 0.5}, "r", 0)
    b = ReferenceDraft.from_ident({"spec_reference": list(cont), "spec_accept": 0.5}, "r", 0)
    assert [a.draft(0, 8) for _ in range(5)] == [b.draft(0, 8) for _ in range(5)]  # seeded by the request


def test_proposer_drafts_a_reference_instead_of_its_trees():
    p = make_proposer(scopes="request", k=6)
    batch = ProposerBatch(p)
    ref = [7, 8, 9, 10, 11, 12, 13, 14]
    batch.add("a", [1, 2, 3], "g", spec_reference=ref, spec_accept=1.0, spec_window=4)
    batch.add("b", [1, 2, 3, 1, 2], "g")  # an ordinary request beside it: tree drafts
    batch.add("c", [5, 6], "g", spec_reference=ref, spec_accept="bad")  # a bad value: no drafts, no crash
    d = batch.step()
    assert d["a"] == [7, 8, 9, 10]  # the continuation after the prompt, cut to the window
    assert d["b"] == [3, 1, 2]  # the request tree's own match
    assert d["c"] == []
    d = batch.step({"a": [7, 8, 9]})  # three tokens emitted: the next draft starts after them
    assert d["a"] == [10, 11, 12, 13]
    batch.finish("a")
    batch.step()
    assert "a" not in p._reference


def test_measured_tables_take_the_fastest_window_and_load_as_a_ladder(tmp_path):
    m = EngineLadder((1, 8), (0.0, 0.8), (1, 4), 64)
    m.plain_s = {1: 10.0, 8: 20.0}
    m.spec_s = {(1, 0.0, 1): 11.0, (1, 0.0, 4): 12.0, (1, 0.8, 1): 8.0, (1, 0.8, 4): 5.0,
                (8, 0.0, 1): 24.0, (8, 0.0, 4): 30.0, (8, 0.8, 1): 19.0, (8, 0.8, 4): 21.0}
    sp, win = m.tables()
    assert win == [[1, 4], [1, 1]]
    assert sp == [[pytest.approx(10 / 11), 2.0], [pytest.approx(20 / 24), pytest.approx(20 / 19)]]
    methods = [DraftMethod("ngram", "suffix", 0.8, scopes="request"), DraftMethod("suffix", "suffix", 0.1)]
    lad = ladder_from(m, methods, "engine:toy", "vllm-cpu", "toy")
    path = tmp_path / "lad.json"
    lad.save(path)
    back = DraftLadder.load(path)
    assert back.select(1) == "ngram" and back.best_window("ngram", 0.8, 1) == 4
    assert back.select(8) == "ngram"  # 20/19 = 1.053 >= MIN_SPEEDUP at its 0.8
    assert back.select(8, {"ngram": 0.0, "suffix": 0.0}) is None  # no method pays: plain decoding
    with pytest.raises(LadderError, match="model-free"):
        ladder_from(m, [DraftMethod("q", "model", 0.6, drafter="h100-0.5b")], "t")
    # specactor reads it; decoupled execution needs a verifier cost model, which it does not have
    from verl_ext.pipe import make_strategy
    from verl_ext.pipe.strategy import StrategyConfigError

    lad = ladder_from(m, methods, "engine:toy")
    lad.save(path)
    assert make_strategy("specactor", {"ladder": str(path)}).select(1) == "ngram"
    with pytest.raises(StrategyConfigError, match="measured on an engine"):
        make_strategy("specactor", {"ladder": str(path), "execution": "decoupled"})
    make_strategy("specactor", {"ladder": str(path), "execution": "decoupled", "profile": "cpu-smollm2"})


def test_the_drafters_idle_cost_decides_whether_engines_start_with_one(tmp_path):
    """``drafter_gain`` over a step draining from ``batch`` to 1, computed by hand; specactor starts
    plain engines where drafting in the tail does not repay the drafting engine's idle cost."""
    m = EngineLadder((1, 8), (0.0, 0.8), (1, 4), 64)
    m.plain_s = {1: 10.0, 8: 20.0}
    m.idle_s = {1: 11.0, 8: 26.0}  # 10% (batch 1) and 30% (batch 8) slower with nothing drafted
    m.spec_s = {(1, 0.0, 1): 11.0, (1, 0.0, 4): 12.0, (1, 0.8, 1): 8.0, (1, 0.8, 4): 5.0,
                (8, 0.0, 1): 24.0, (8, 0.0, 4): 30.0, (8, 0.8, 1): 19.0, (8, 0.8, 4): 21.0}
    lad = ladder_from(m, [DraftMethod("ngram", "suffix", 0.4, scopes="request")], "engine:toy")
    assert lad.step_s == [10 / 64, 20 / 64] and lad.idle == pytest.approx([0.1, 0.3])
    # at p = 0.4: batch 1 -> 10/11 + (2 - 10/11) / 2 = 1.4545; batch 8 -> 20/24 + (20/19 - 20/24) / 2
    # = 0.943; in between, linear in log2(batch): it pays (>= 1.02) up to batch 5; from 6 on the
    # engine decodes plainly, slower by the interpolated idle cost
    s1, s8 = (10 / 11 + 2.0) / 2, (20 / 24 + 20 / 19) / 2
    speedup = [s1 + (s8 - s1) * math.log2(b) / 3 for b in range(1, 9)]
    t = [10 / 64 + (b - 1) * (10 / 64) / 7 for b in range(1, 9)]  # plain step time, interpolated
    idle = [0.1 + (b - 1) * 0.2 / 7 for b in range(1, 9)]
    assert [s >= 1.02 for s in speedup] == [True] * 5 + [False] * 3
    assert lad.drafter_gain(1) == pytest.approx(1 - 1 / s1)
    assert lad.drafter_gain(2) == pytest.approx(1 - (t[0] / s1 + t[1] / speedup[1]) / (t[0] + t[1]))
    gain8 = 1 - (sum(x / s for x, s in zip(t[:5], speedup)) + sum(x * (1 + o) for x, o in zip(t[5:], idle[5:]))) / sum(t)
    assert gain8 < 0 and lad.drafter_gain(8) == pytest.approx(gain8)
    assert lad.drafter_gain(8, {"ngram": 0.8}) > 0  # 0.8 pays at every batch
    path = tmp_path / "lad.json"
    lad.save(path)
    back = DraftLadder.load(path)
    assert back.idle == lad.idle and back.step_s == lad.step_s

    from verl_ext.pipe import make_strategy

    st = make_strategy("specactor", {"ladder": str(path), "batch": 8})
    assert st.select(1) == "ngram" and st.engine_spec() is None  # pays for a lone request, not overall
    assert st.metrics()["engine_drafter"] == 0.0 and st.metrics()["engine_drafter_gain"] == pytest.approx(gain8)
    assert make_strategy("specactor", {"ladder": str(path), "batch": 2}).engine_spec() is not None
    assert make_strategy("specactor", {"ladder": str(path), "batch": 8, "acceptance": "ngram=0.8"}).engine_spec() is not None
    # a ladder without a measured idle cost (cost-model ladders) counts it as 0
    lad.idle = []
    lad.save(path)
    assert DraftLadder.load(path).drafter_gain(8) > 0
    assert make_strategy("specactor", {"ladder": str(path), "batch": 8}).engine_spec() is not None
    bad = lad.to_dict()
    bad["idle"] = [0.1]
    with pytest.raises(LadderError, match="one value per batch"):
        DraftLadder.from_dict(bad)


@pytest.mark.engine
async def test_engine_ladder_on_vllm_cpu(fp32_engine, spec_engine, model_dir):
    """On the real engine: at rate 1 every reference draft is accepted and the outputs are the
    plain engine's (``measure`` checks that); at rate 0 none is; the tables are filled."""
    from transformers import AutoTokenizer

    from verl_ext.workload.arith import encode_prompts, make_problems

    prompts = encode_prompts(AutoTokenizer.from_pretrained(str(model_dir)), make_problems(2, seed=5))
    lad = await measure(fp32_engine, spec_engine, prompts, batches=(1, 2), rates=(0.0, 1.0), windows=(1, 4),
                        max_tokens=24)
    for b in (1, 2):
        for w in (1, 4):
            assert lad.accepted[(b, 1.0, w)] == 1.0
            assert lad.accepted[(b, 0.0, w)] == 0.0
            assert lad.spec_s[(b, 1.0, w)] > 0 and lad.plain_s[b] > 0 and lad.idle_s[b] > 0
    sp, win = lad.tables()
    assert np.shape(sp) == (2, 2) and all(w in (1, 4) for row in win for w in row)
    with pytest.raises(ValueError, match="prompts needed"):
        await measure(fp32_engine, spec_engine, prompts[:1], batches=(2,), rates=(1.0,), windows=(1,))
