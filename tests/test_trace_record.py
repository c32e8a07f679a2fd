"""`verl-ext trace record`: bad input (fast), and a tiny recording on the shared real engine."""

import numpy as np
import pytest
from _util import SharedEngineFactory

from verl_ext.trace import read_trace
from verl_ext.cli import main as cli_main
from verl_ext.ab.record import RecordConfig, arecord_trace
from verl_ext.workload.arith import make_problems


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompts", "0"], "--prompts must be an integer >= 1, got 0"),
        (["--samples", "0"], "--samples must be an integer >= 1"),
        (["--epochs", "0"], "--epochs must be an integer >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
        (["--instances", "0"], "--instances must be an integer >= 1"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--difficulty", "9"], "difficulty"),
        (["--out", "x.json"], "--out must name a .parquet file"),
        (["--strategy", "nope"], "unknown rollout strategy 'nope'"),
        (["--strategy", "baseline+spec:history"], "history scope"),
    ],
)
def test_bad_input_exits_2(args, match, capsys, tmp_path):
    out = [] if "--out" in args else ["--out", str(tmp_path / "t.parquet")]
    assert cli_main(["trace", "record", *args, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("verl-ext: error: ") and match in err and "\n" not in err
    assert not (tmp_path / "t.parquet").exists()


def test_bad_model_and_out_dir(capsys, tmp_path):
    assert cli_main(["trace", "record", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "t.parquet")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "d.parquet").mkdir()
    assert cli_main(["trace", "record", "--out", str(tmp_path / "d.parquet")]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.engine
async def test_record_tiny_on_real_engine(fp32_engine, model_dir, tmp_path):
    cfg = RecordConfig(prompts=2, samples=2, epochs=2, max_tokens=16, instances=1, seed=3, temperature=0.8,
                       difficulty=1, keyed_sampling=True, out=str(tmp_path / "tiny.parquet"))
    t = await arecord_trace(cfg, engine_factory=SharedEngineFactory(fp32_engine), progress=False)
    back = read_trace(cfg.out)
    assert len(back) == len(t) == 8 and back.epochs() == [0, 1]
    uids = [p.uid for p in make_problems(2, seed=3, difficulty=1)]
    assert back.prompt_uid.tolist() == [uids[0]] * 2 + [uids[1]] * 2 + [uids[0]] * 2 + [uids[1]] * 2
    assert back.sample_index.tolist() == [0, 1] * 4 and (back.step == back.epoch).all()
    assert back.meta["seeds"]["sampling"] == 3 and back.meta["seeds"]["keyed"] and back.meta["source"] == "real"
    assert back.meta["workload"]["difficulty"] == 1
    lengths = back.response_lengths()
    assert 1 <= lengths.min() and lengths.max() <= 16
    assert set(back.finish_reason.tolist()) <= {"stop", "length"}
    assert (lengths[back.finish_reason == "length"] == 16).all() and (lengths[back.finish_reason == "stop"] <= 16).all()
    assert set(back.instance.tolist()) == {fp32_engine.name}
    assert back.submit_s.min() == 0.0 and (back.finish_s >= back.submit_s).all()
    np.testing.assert_array_equal(back.token_time_offsets, back.response_offsets)
    assert (np.diff(back.times(0)) >= 0).all()
    # same prompts both epochs, different sampling seeds
    assert back.prompt(0).tolist() == back.prompt(4).tolist()
    assert fp32_engine.engine is not None  # the shared engine is still up
    # the trace holds what `verl-ext ab` rolls out for the same flags: its second epoch's last
    # request, built by ab and generated alone, samples the recorded tokens
    from transformers import AutoTokenizer

    from verl_ext.ab.runner import ABConfig, build_requests
    from verl_ext.workload.arith import encode_prompts

    problems = make_problems(2, seed=3, difficulty=1)
    ab = ABConfig(prompts=2, samples=2, max_tokens=16, instances=1, seed=3, temperature=0.8, epochs=2,
                  difficulty=1, keyed_sampling=True)
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(str(model_dir)), problems)
    request = build_requests(problems, prompt_ids, ab, tuple(back.meta["stop_token_ids"]), epoch=1)[-1]
    alone = await fp32_engine.generate(request)
    assert list(alone.token_ids) == back.response(7).tolist()
