"""Drafting engines' step logs (``VERL_EXT_STEPLOG``) and the draft-cost fit on them
(``verl-ext fit steplog``). CPU only; the proposer runs behind a runner stand-in."""

import json

import numpy as np
import pytest

from verl_ext.perf.cost import CostModel, load_cost_model
from verl_ext.cli import main as cli_main
from verl_ext.perf.steplog_fit import WINDOW_STEPS, fit_draft_costs, steplog_windows
from verl_ext.perf.steplog import ENV, FIELDS, read_steplog

BASE = dict(name="toy-cpu", overhead_s=0.02, weight_s=0.0, token_s=1e-3, kv_token_s=5e-6, prefill_token_s=0.0,
            draft_token_s=0.0, kv_capacity_tokens=50_000, max_num_seqs=64, max_batched_tokens=65_536)


def test_draft_context_term_of_the_step_time():
    """draft_kv_token_s charges each draft token its request's context, read as the step's mean
    context; presets without the field load with 0 (it is optional)."""
    c = CostModel(**BASE, draft_kv_token_s=2e-6)
    plain = CostModel(**BASE)
    # 4 requests, 800 KV tokens (mean context 200), 10 drafts: 10 x 200 x 2 us more
    assert c.step_time(4, 800, 0, 10) - plain.step_time(4, 800, 0, 10) == pytest.approx(10 * 200 * 2e-6)
    assert c.step_time(4, 800, 0, 0) == plain.step_time(4, 800, 0, 0)
    assert CostModel.from_dict({k: v for k, v in BASE.items()}).draft_kv_token_s == 0.0
    assert load_cost_model("h100-7b").draft_kv_token_s == 0.0
    # the batch threshold counts it: a draft at a 4k context costs token_s + 4096 x 2 us
    assert c.draft_thresholds()["knee_tokens"] == int(0.02 / (1e-3 + 4096 * 2e-6))
    with pytest.raises(ValueError, match="draft_kv_token_s"):
        CostModel.from_dict({**BASE, "draft_kv_token_s": -1.0})


def test_proposer_logs_each_step(tmp_path, monkeypatch):
    """Each record is the step that ended at the drafter's call: its requests, their contexts
    before it, its prefill, and the drafts it verified (the previous call's), with their contexts."""
    from _util import ProposerBatch, make_proposer

    monkeypatch.setenv(ENV, str(tmp_path / "log"))
    p = make_proposer(scopes="request", k=4)
    b = ProposerBatch(p, verify_drafts=True)
    patterns = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9]}
    b.add("a", patterns["a"] * 6, "g")
    b.add("b", patterns["b"] * 5, "g")
    history = [b.step()]  # both prefill
    for i in range(6):
        emit = {r: [patterns[r][(len(b.rows[r]) + 0) % len(patterns[r])]] for r in b.rows}
        history.append(b.step(emit))
    p.steplog.close()
    (path,) = tmp_path.glob("log.*.jsonl")
    cols = read_steplog([path])
    assert set(cols) == set(FIELDS) and len(cols["batch"]) == len(history) - 1  # the first call only starts the clock
    assert (cols["batch"] == 2).all() and (cols["prefill_tokens"] == 0).all()
    assert (cols["period_s"] > 0).all() and (cols["propose_s"] > 0).all()
    lens = {"a": 24, "b": 25}
    for i, prev in enumerate(history[:-1]):
        for r in lens:
            lens[r] += 1
        ctx = {r: lens[r] - 1 for r in lens}  # each row emitted one token in the step
        assert cols["kv_tokens"][i] == sum(ctx.values())
        assert cols["draft_tokens"][i] == sum(len(d) for d in prev.values())
        assert cols["draft_kv_tokens"][i] == sum(len(prev[r]) * ctx[r] for r in ctx)
    assert cols["draft_tokens"].sum() > 0  # the patterns are drafted


def test_proposer_does_not_log_without_the_variable(monkeypatch):
    from _util import make_proposer

    monkeypatch.delenv(ENV, raising=False)
    assert make_proposer(scopes="request", k=4).steplog is None


def _write_log(path, cost: CostModel, speed: float, rng, steps=600, noise=0.03):
    """A synthetic engine's log: decode steps timed by ``cost`` x ``speed`` with noise, every
    50th step a prefill."""
    with open(path, "w") as f:
        for i in range(steps):
            b = int(rng.integers(1, 33))
            kv = int(b * rng.integers(100, 400))
            d = int(rng.integers(0, 4 * b + 1)) if i % 3 else 0
            pf = 300 if i % 50 == 0 else 0
            t = speed * cost.step_time(b, kv, pf, d) * (1 + noise * rng.standard_normal())
            rec = [t, b, kv, pf, d, d * kv / b, 1e-4]
            f.write(json.dumps(dict(zip(FIELDS, rec))) + "\n")


def test_fit_recovers_draft_costs_and_the_speed_of_the_run(tmp_path):
    truth = CostModel(**{**BASE, "draft_token_s": 3e-4, "draft_kv_token_s": 4e-6})
    rng = np.random.default_rng(0)
    for e in range(2):
        _write_log(tmp_path / f"log.{e}.jsonl", truth, speed=1.15, rng=rng)
    windows = steplog_windows(sorted(tmp_path.glob("log.*.jsonl")))
    # prefill steps cut the runs of decode-only steps; no window spans two files
    assert windows and all(w["steps"] == WINDOW_STEPS for w in windows)
    assert len(windows) <= 2 * 600 // WINDOW_STEPS - 2 * 600 // 50 // WINDOW_STEPS
    fitted, rep = fit_draft_costs(windows, CostModel(**BASE))
    assert rep["speed_factor"] == pytest.approx(1.15, rel=0.02)
    # a draft's price at a typical context; the two terms trade off a little under noise
    assert fitted.draft_token_s + 250 * fitted.draft_kv_token_s == pytest.approx(3e-4 + 250 * 4e-6, rel=0.05)
    assert fitted.draft_kv_token_s == pytest.approx(4e-6, rel=0.15)
    for k in ("overhead_s", "token_s", "kv_token_s", "prefill_token_s"):  # only the draft costs move
        assert getattr(fitted, k) == BASE[k]
    heavy = [x for x in rep["bins"] if x["drafts_per_step"] == "16-64"][0]
    assert heavy["base_mean_rel_err"] < -0.2 and abs(heavy["fitted_mean_rel_err"]) < 0.02
    assert rep["fitted_mean_abs_rel_err"] < rep["base_mean_abs_rel_err"]


def test_fit_refuses_logs_it_cannot_fit(tmp_path):
    rng = np.random.default_rng(1)
    _write_log(tmp_path / "few.jsonl", CostModel(**BASE), 1.0, rng, steps=20)
    with pytest.raises(ValueError, match="at least 5 decode-only windows"):
        fit_draft_costs(steplog_windows([tmp_path / "few.jsonl"]), CostModel(**BASE))
    with open(tmp_path / "plain.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps(dict(zip(FIELDS, [0.05, 4, 800, 0, 0, 0, 0.0]))) + "\n")
    with pytest.raises(ValueError, match="no drafts"):
        fit_draft_costs(steplog_windows([tmp_path / "plain.jsonl"]), CostModel(**BASE))
    (tmp_path / "bad.jsonl").write_text('{"period_s": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a step-log record"):
        read_steplog([tmp_path / "bad.jsonl"])


def test_profile_cli_fits_steplogs_onto_a_base(tmp_path, capsys):
    truth = CostModel(**{**BASE, "draft_token_s": 3e-4, "draft_kv_token_s": 4e-6})
    _write_log(tmp_path / "s.1.jsonl", truth, 1.0, np.random.default_rng(2))
    base = tmp_path / "base.json"
    base.write_text(json.dumps(BASE))
    out = tmp_path / "fit.json"
    assert cli_main(["fit", "steplog", str(tmp_path / "s.*.jsonl"), "--base", str(base), "--out", str(out)]) == 0
    fitted = load_cost_model(str(out))
    assert fitted.name == "fit" and fitted.draft_kv_token_s == pytest.approx(4e-6, rel=0.2)
    assert json.loads(out.read_text())["fit"]["files"] == 1
    assert "draft_kv_token_s" in capsys.readouterr().out
    assert cli_main(["profile", "--from-steplog", str(tmp_path / "s.*.jsonl"), "--out", str(out)]) == 2  # the old spelling
    assert "needs --base" in capsys.readouterr().err
    assert cli_main(["fit", "steplog", str(tmp_path / "none*.jsonl"), "--base", str(base), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
