"""The global drafting scope outside the native index (issue 51 part 1): its options, the index an
engine gets, the simulator's refusal where its tree would depend on replay order, and
``scope_replay`` (every scope fed as the drafter feeds it) on hand-made and committed traces."""

from pathlib import Path

import numpy as np
import pytest

from verl_ext.spec import SCOPE_GLOBAL, SpecOptions
from verl_ext.trace.synth.similarity import scope_replay
from verl_ext.trace.format import Trace, read_trace

REPO = Path(__file__).resolve().parents[1]


def test_global_scope_options_and_index():
    spec = SpecOptions(scopes="request+global", global_tokens=1000)
    assert spec.mask & SCOPE_GLOBAL
    assert spec.new_index().global_tokens == 1000
    assert SpecOptions(scopes="request+group").new_index().global_tokens == 0  # off unless named
    with pytest.raises(ValueError, match="global_tokens must be >= 1"):
        SpecOptions(scopes="global", global_tokens=0)
    with pytest.raises(ValueError, match="unknown drafting scope 'globl'"):
        SpecOptions(scopes="globl")


def _trace():
    """Two epochs of 3 prompts x 2 samples. In epoch 1 each prompt's responses repeat what
    another prompt got in epoch 0: only the global scope has seen them."""
    rng = np.random.default_rng(0)
    text = {p: rng.integers(10, 500, size=40).tolist() for p in range(3)}
    rows = []
    for epoch in (0, 1):
        for p in range(3):
            for s in range(2):
                resp = text[p] if epoch == 0 else text[(p + 1) % 3]
                rows.append({"epoch": epoch, "prompt_uid": f"p{p}", "sample_index": s, "prompt_ids": [1, 2, 3 + p],
                             "response_ids": list(resp), "reward": 1.0, "finish_reason": "stop"})
    return Trace.from_rows(rows)


def test_scope_replay_credits_the_global_scope_where_only_it_has_seen_the_text():
    trace = _trace()
    glob = scope_replay(trace, SpecOptions(scopes="global", k=8))
    hist = scope_replay(trace, SpecOptions(scopes="history", k=8))
    assert glob["epoch"] == 1 and glob["responses"] == 6
    # epoch 1's text is another prompt's epoch-0 text: history (this prompt's past) misses it
    assert hist["tokens_per_step"] < 1.6 < glob["tokens_per_step"]
    assert glob["tokens"] == 6 * 40 and glob["steps"] < hist["steps"]


def test_scope_replay_on_the_committed_t1_trace():
    trace = read_trace(REPO / "data" / "traces" / "smollm2_arith_e2.parquet")
    one = {s: scope_replay(trace, SpecOptions(scopes=s, k=8)) for s in ("request", "global", "request+global")}
    for r in one.values():
        assert r["tokens"] == int(trace.response_lengths()[trace.epoch == 1].sum())
        assert 1.0 < r["tokens_per_step"] < 1.5 and 0.0 < r["acceptance"] < 1.0
    # two scopes in one draft do at least as well as the request scope alone on real rollouts
    assert one["request+global"]["tokens_per_step"] > one["request"]["tokens_per_step"]


def test_the_simulator_drafts_from_the_global_scope_only_in_exact_mode():
    from verl_ext.sim.drafting import ReplayDrafter
    from verl_ext.sim.source import TraceSource

    trace = _trace()
    source = TraceSource(trace, np.flatnonzero(trace.epoch == 1))
    spec = SpecOptions(scopes="request+global")
    for mode in ("cached", "lockstep"):
        with pytest.raises(ValueError, match="cannot draft from the global scope; use exact"):
            ReplayDrafter(spec, source, mode=mode)
    auto = ReplayDrafter(spec, source)
    assert auto.mode == "exact" and auto.index.global_tokens == spec.global_tokens
