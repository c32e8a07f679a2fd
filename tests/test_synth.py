"""Synthetic long-tail workloads (verl_ext/trace/synth/): CPU-only, a few seconds.

The token source is the committed real trace (data/traces/smollm2_arith_e2.parquet) or, before
it exists, the replay data it supersedes (data/replay_smollm2_arith.json.gz)."""

import dataclasses

import numpy as np
import pytest

from verl_ext.trace.format import read_trace, write_trace
from verl_ext.trace.synth import (
    SIMILARITY_LEVELS,
    SynthConfig,
    length_stats,
    load_source,
    similarity_stats,
    synthesize,
    with_level,
)

SMALL = SynthConfig(prompts=16, samples=8, epochs=2, mean_len=512, max_len=2048, min_len=32, prompt_len=(32, 256), seed=3)


@pytest.fixture(scope="module")
def source():
    return load_source()


@pytest.fixture(scope="module")
def small(source):
    return synthesize(SMALL, source)


def reuse(trace):
    return similarity_stats(trace, groups=0)["reuse_fraction"]


def test_deterministic_by_seed(source, small):
    again = synthesize(SMALL, source)
    assert np.array_equal(small.response_tokens, again.response_tokens)
    assert np.array_equal(small.response_offsets, again.response_offsets)
    assert np.array_equal(small.prompt_tokens, again.prompt_tokens)
    assert list(small.prompt_uid) == list(again.prompt_uid)
    other = synthesize(dataclasses.replace(SMALL, seed=4), source)
    assert not np.array_equal(small.response_offsets, other.response_offsets)


def test_shape_lengths_and_fields(small):
    small.validate()
    n = SMALL.prompts * SMALL.samples * SMALL.epochs
    assert len(small) == n
    L = small.response_lengths()
    assert L.min() >= SMALL.min_len and L.max() <= SMALL.max_len
    assert abs(L.mean() - SMALL.mean_len) / SMALL.mean_len < 0.01
    assert np.array_equal(small.finish_reason == "length", L == SMALL.max_len)
    P = small.prompt_lengths()
    assert P.min() >= SMALL.prompt_len[0] and P.max() <= SMALL.prompt_len[1]
    assert len(set(small.prompt_uid)) == SMALL.prompts
    for e in range(SMALL.epochs):  # every (prompt, sample) once per epoch, same prompt across epochs
        rows = np.flatnonzero(small.epoch == e)
        assert len({(small.prompt_uid[i], small.sample_index[i]) for i in rows}) == SMALL.prompts * SMALL.samples
    first = {small.prompt_uid[i]: small.prompt(i).tolist() for i in range(len(small))}
    assert all(small.prompt(i).tolist() == first[small.prompt_uid[i]] for i in range(len(small)))
    assert small.meta["source"] == "synthetic"
    assert small.meta["synth"]["config"] == SMALL.to_dict()
    assert small.meta["synth_source"]["rows"] > 0


def test_tokens_come_from_the_source(source, small):
    assert np.isin(np.unique(small.response_tokens), np.unique(source.response_tokens)).all()
    assert np.isin(np.unique(small.prompt_tokens), np.unique(source.prompt_tokens)).all()
    # chapter 0 of sample 0 is a real response to the real prompt: it starts a source response
    starts = {tuple(source.response(i)[:16].tolist()) for i in range(len(source)) if source.response_lengths()[i] >= 16}
    r0 = small.response(int(np.flatnonzero(small.sample_index == 0)[0]))
    assert tuple(r0[:16].tolist()) in starts


def test_round_trip_through_the_trace_format(small, tmp_path):
    path = tmp_path / "synth.parquet"
    write_trace(small, path)
    back = read_trace(path)
    assert np.array_equal(back.response_tokens, small.response_tokens)
    assert back.meta["synth"]["config"]["prompt_len"] == list(SMALL.prompt_len)


def test_reuse_knob_is_monotone_and_zero_keeps_the_source_level(source):
    base = reuse(source)  # RhymeRL §5.1 metric on the real trace
    cfg = dataclasses.replace(SMALL, prompts=24, prompt_len=(0, 0))
    r = [reuse(synthesize(dataclasses.replace(cfg, epoch_similarity=e), source)) for e in (0.0, 0.25, 0.5, 0.8)]
    assert abs(r[0] - base) < 0.03, (r[0], base)
    assert all(b > a + 0.1 for a, b in zip(r, r[1:])), r
    assert r[-1] > 0.75


def test_group_knob_raises_the_grouped_gain(source):
    kw = dict(groups=6, targets=2, max_tokens=384)
    g0 = similarity_stats(synthesize(SMALL, source), **kw)["group"]
    g1 = similarity_stats(synthesize(dataclasses.replace(SMALL, group_similarity=0.4), source), **kw)["group"]
    assert g0["accepted_request"] > 0
    assert g1["gain"] > g0["gain"] + 0.5
    assert g1["tokens_per_step_group"] > g0["tokens_per_step_group"]


def test_levels(source):
    for name in ("measured", "published"):
        lv = SIMILARITY_LEVELS[name]
        assert lv["label"] and lv["source"]
    pub = reuse(synthesize(with_level(SMALL, "published"), source))
    meas = reuse(synthesize(with_level(SMALL, "measured"), source))
    assert meas < 0.25 < pub < 0.95
    assert synthesize(with_level(SMALL, "published"), source).meta["synth"]["similarity_level"] == "published"
    with pytest.raises(ValueError, match="unknown similarity level"):
        with_level(SMALL, "nope")


def test_the_tying_knobs_make_scopes_overlap_as_on_real_traces(source):
    """At a level's knobs the cross-epoch scope (history) and the in-epoch ones (request, group)
    add up; ``shared_path`` (a group follows one previous-epoch response) and
    ``self_from_history`` (a response repeats what it took from the previous epoch) make the
    same tokens reachable from both, so a pair is worth less than the sum of its scopes. At 0
    they leave the workload as it was."""
    from verl_ext.spec import SpecOptions
    from verl_ext.trace.synth.similarity import scope_replay

    base = with_level(dataclasses.replace(SMALL, prompts=24, mean_len=256, max_len=1024), "published")
    assert synthesize(dataclasses.replace(base, shared_path=0.0, self_from_history=0.0), source).response_tokens.tobytes() == \
        synthesize(base, source).response_tokens.tobytes()

    def overlap(trace, a, b):
        g = {s: scope_replay(trace, SpecOptions(scopes=s, k=8))["tokens_per_step"] - 1 for s in (a, b, f"{a}+{b}")}
        return (g[a] + g[b] - g[f"{a}+{b}"]) / min(g[a], g[b])

    loose = synthesize(base, source)
    tied = synthesize(dataclasses.replace(base, shared_path=1.0, self_from_history=1.0), source)
    assert tied.response_tokens.tobytes() != loose.response_tokens.tobytes()
    for a, b in (("request", "history"), ("group", "history")):
        assert overlap(tied, a, b) > overlap(loose, a, b) + 0.1, (a, b)


def test_what_a_response_copies_from_a_sibling_its_group_holds(source):
    """Sibling copies come from one template response per group, read after its own copies, so
    the text a response copied is in its group's tree: with nearly all text copied, grouped
    drafts run close to the draft limit (k = 8). Copies from siblings' texts that their own
    copies then overwrote left 2.2 tokens per step here."""
    cfg = dataclasses.replace(SMALL, group_similarity=0.95, prompt_len=(0, 0))
    g = similarity_stats(synthesize(cfg, source), groups=8, targets=2, max_tokens=512)["group"]
    assert g["tokens_per_step_group"] > 5.0 > 1.5 > g["tokens_per_step_request"]


@pytest.mark.parametrize("kind,knob", [("history", "epoch"), ("sibling", "group")])
def test_edit_rates_put_back_a_share_of_copied_tokens(source, kind, knob):
    """``<scope>_edit_rate``: that share of the scope's copied tokens is the response's own
    token instead, which shortens the drafts a copy feeds."""
    base = dataclasses.replace(SMALL, **{f"{knob}_similarity": 0.9})
    plain, edited = synthesize(base, source), synthesize(dataclasses.replace(base, **{f"{knob}_edit_rate": 0.1}), source)
    copied = edited.meta["synth"]["copied_tokens"][kind]
    assert copied > 10_000 and abs(edited.meta["synth"]["edited_tokens"] / copied - 0.1) < 0.01
    assert plain.meta["synth"]["edited_tokens"] == 0
    scope = "history" if kind == "history" else "group"
    key = "tokens_per_step_history" if kind == "history" else "tokens_per_step_group"
    kw = dict(groups=8, targets=2, max_tokens=512)
    assert similarity_stats(edited, **kw)[scope][key] < 0.8 * similarity_stats(plain, **kw)[scope][key]


@pytest.mark.parametrize("rho", [0.7, 0.95])
def test_rank_stability_across_epochs(source, rho):
    cfg = SynthConfig(prompts=400, samples=4, epochs=2, mean_len=128, max_len=512, min_len=8, epoch_rho=rho,
                      outlier_frac=0.0, prompt_len=(0, 0), seed=1)
    s = length_stats(synthesize(cfg, source))
    assert abs(s["spearman_group_median"] - rho) < 0.08, s["spearman_group_median"]


def test_default_length_shape(source):
    """Seer §6.2.2 tail share ~50%, RhymeRL §6.1 ~16% move up (8 rank groups), RLHFSpec p95/p50
    ~3.6, at the default shape scaled down (max_len = 4 x mean_len as in the default)."""
    cfg = SynthConfig(prompts=256, samples=16, epochs=2, mean_len=256, max_len=1024, min_len=2, prompt_len=(0, 0))
    s = length_stats(synthesize(cfg, source))
    assert 0.35 <= s["tail_share_last10"] <= 0.6, s
    assert 0.08 <= s["rank_up_8"] <= 0.24, s
    assert 2.8 <= s["p95_over_p50"] <= 4.5, s
    assert s["within_group_icc"] > 0.8


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mean_len=5000, max_len=4096), "mean_len"),
        (dict(max_len=32, min_len=64, mean_len=48), "max_len"),
        (dict(group_similarity=-0.1), "group_similarity"),
        (dict(epoch_similarity=-0.5), "epoch_similarity"),
        (dict(self_similarity=1.5), "self_similarity"),
        (dict(group_similarity=0.6, epoch_similarity=0.6), "epoch_similarity"),
        (dict(samples=0), "samples"),
        (dict(prompts=0), "prompts"),
        (dict(epoch_rho=1.5), "epoch_rho"),
        (dict(prompt_len=(10, 5)), "prompt_len"),
        (dict(shared_path=1.2), "shared_path"),
        (dict(self_from_history=-0.1), "self_from_history"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SynthConfig(**kwargs)
