"""The rollout trace format (verl_ext.trace): round trips, transforms, errors, speed, and the
committed real trace. CPU only, no engine."""

import json
import math
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from verl_ext.trace import TRACE_FORMAT, TRACE_VERSION, Trace, TraceFormatError, read_trace, write_trace  # noqa: E402
from verl_ext.trace.format import to_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "data" / "traces" / "smollm2_arith_e2.parquet"


def make_rows(with_times=True):
    rows = []
    for e in range(2):
        for g in range(3):
            for s in range(2):
                n = (e * 7 + g * 3 + s * 5) % 6  # includes empty responses
                rows.append(
                    {
                        "epoch": e,
                        "step": 10 + e,
                        "prompt_uid": f"p{g}",
                        "sample_index": s,
                        "prompt_ids": list(range(g + 1)) if g != 2 else [],  # an empty prompt, too
                        "response_ids": [100 + i for i in range(n)] + ([2**31 - 1] if n else []),
                        "reward": float(s) if g != 1 else None,
                        "finish_reason": ["stop", "length", "abort"][(g + s) % 3],
                        "instance": f"vllm-{s}" if g else None,
                        "submit_s": 0.5 * g if e == 0 else None,
                        "finish_s": 1.0 + g if e == 0 else None,
                        "token_times": ([0.1 * i for i in range(n + (1 if n else 0))] if (with_times and s == 0) else None),
                    }
                )
    return rows


META = {"source": "synthetic", "model": "m", "seeds": [0, 1], "nested": {"a": 1}}


def assert_same(a: Trace, b: Trace):
    assert len(a) == len(b)
    for name in ("epoch", "step", "sample_index", "prompt_tokens", "prompt_offsets", "response_tokens",
                 "response_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in ("reward", "submit_s", "finish_s"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)  # NaNs compare equal here
    for name in ("prompt_uid", "finish_reason", "instance"):
        assert list(getattr(a, name)) == list(getattr(b, name)), name
    assert (a.token_times is None) == (b.token_times is None)
    if a.token_times is not None:
        np.testing.assert_array_equal(a.token_times, b.token_times)
        np.testing.assert_array_equal(a.token_time_offsets, b.token_time_offsets)
    assert a.meta == b.meta


# -- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("with_times", [True, False])
def test_round_trip(tmp_path, with_times):
    rows = make_rows(with_times)
    t = Trace.from_rows(rows, meta=META)
    t.validate()
    assert len(t) == 12 and t.epochs() == [0, 1]
    assert t.prompt_tokens.dtype == np.int32 and t.prompt_offsets.dtype == np.int64
    assert t.prompt(0).tolist() == [0] and t.prompt(4).tolist() == []
    assert t.response_lengths().tolist() == [len(r["response_ids"]) for r in rows]
    assert (t.token_times is None) == (not with_times)
    path = tmp_path / "t.parquet"
    write_trace(t, path)
    back = read_trace(path)
    assert_same(t, back)
    assert back.response_lists.type == pa.large_list(pa.int32()) and len(back.prompt_lists) == 12
    assert_same(pickle.loads(pickle.dumps(back)), back)
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temp file left behind
    # rows survive too (NaN for unknown values, None for unknown instance / token times)
    out = back.to_rows()
    assert out[0]["prompt_ids"] == rows[0]["prompt_ids"] and out[2]["reward"] != out[2]["reward"]  # NaN
    assert out[0]["instance"] is None and out[2]["instance"] == "vllm-0"
    assert math.isnan(out[-1]["submit_s"]) and out[0]["submit_s"] == 0.0
    if with_times:
        assert out[0]["token_times"] == pytest.approx(rows[0]["token_times"])
        assert out[1]["token_times"] == []  # unknown for that row
    else:
        assert all(r["token_times"] is None for r in out)
    assert_same(Trace.from_rows(out, meta=META), back)
    schema = pq.read_schema(path)
    assert schema.metadata[b"verl_ext.trace.format"] == TRACE_FORMAT.encode()
    assert schema.metadata[b"verl_ext.trace.version"] == str(TRACE_VERSION).encode()
    assert json.loads(schema.metadata[b"verl_ext.trace.meta"]) == META
    assert ("token_times" in schema.names) == with_times


def test_empty_trace_round_trip(tmp_path):
    t = Trace.from_rows([], meta={"source": "synthetic"})
    assert len(t) == 0 and t.prompt_offsets.tolist() == [0] and t.token_times is None
    write_trace(t, tmp_path / "e.parquet")
    back = read_trace(tmp_path / "e.parquet")
    assert_same(t, back)
    assert back.epochs() == []


def test_all_empty_token_lists(tmp_path):
    rows = [{"epoch": 0, "prompt_uid": "a", "prompt_ids": [], "response_ids": [], "finish_reason": "abort", "token_times": []}]
    t = Trace.from_rows(rows)
    assert t.step.tolist() == [0] and t.sample_index.tolist() == [0]  # defaults
    assert t.token_times is not None and t.token_times.size == 0
    write_trace(t, tmp_path / "a.parquet")
    assert_same(t, read_trace(tmp_path / "a.parquet"))


def test_overwrite_is_atomic_replace(tmp_path):
    path = tmp_path / "sub" / "t.parquet"
    write_trace(Trace.from_rows(make_rows()[:3]), path)
    write_trace(Trace.from_rows(make_rows()), path)
    assert len(read_trace(path)) == 12
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.parquet"]


def test_select_and_concat():
    t = Trace.from_rows(make_rows(), meta=META)
    mask = t.epoch == 1
    s = t.select(mask)
    assert len(s) == 6 and set(s.epoch.tolist()) == {1}
    assert [s.response(i).tolist() for i in range(6)] == [t.response(i).tolist() for i in range(6, 12)]
    assert [s.times(i).tolist() for i in range(6)] == [t.times(i).tolist() for i in range(6, 12)]
    idx = [11, 0, 5, 5]
    r = t.select(idx)
    assert r.prompt_uid.tolist() == [t.prompt_uid[i] for i in idx]
    assert [r.prompt(i).tolist() for i in range(4)] == [t.prompt(i).tolist() for i in idx]
    assert [r.response(i).tolist() for i in range(4)] == [t.response(i).tolist() for i in idx]
    r.validate()
    assert len(t.select(np.zeros(12, bool))) == 0
    with pytest.raises(IndexError):
        t.select([12])
    with pytest.raises(IndexError):
        t.select(np.ones(3, bool))
    # concat of the two halves is the original
    assert_same(Trace.concat([t.select(~mask), t.select(mask)]), t)
    # mixing traces with and without token times: rows of the latter get empty times
    no_times = Trace.from_rows(make_rows(with_times=False)[:2])
    c = Trace.concat([no_times, t.select([0])])
    c.validate()
    assert c.times(0).tolist() == [] and c.times(2).tolist() == pytest.approx(t.times(0).tolist())
    assert Trace.concat([no_times, no_times]).token_times is None
    assert len(Trace.concat([])) == 0


# -- errors -----------------------------------------------------------------------------------------
def good_table():
    return to_table(Trace.from_rows(make_rows(), meta=META))


def write_table(table, path, metadata_update=None, drop=None):
    md = dict(table.schema.metadata)
    md.update(metadata_update or {})
    table = table.replace_schema_metadata({k: v for k, v in md.items() if v is not None})
    if drop:
        table = table.drop_columns([drop])
    pq.write_table(table, path)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match=r"nope\.parquet: no such trace file"):
        read_trace(tmp_path / "nope.parquet")


def test_corrupt_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(TraceFormatError, match=r"junk\.parquet: not a readable Parquet file"):
        read_trace(path)


def test_truncated_file(tmp_path):
    path = tmp_path / "t.parquet"
    write_trace(Trace.from_rows(make_rows()), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match=r"t\.parquet: not a readable Parquet file"):
        read_trace(path)


def test_version_mismatch_names_both_versions(tmp_path):
    path = write_table(good_table(), tmp_path / "v2.parquet", {b"verl_ext.trace.version": b"2"})
    with pytest.raises(TraceFormatError, match=r"v2\.parquet: trace format version 2 is not supported \(this reader supports version 1\)"):
        read_trace(path)
    path = write_table(good_table(), tmp_path / "vx.parquet", {b"verl_ext.trace.version": b"two"})
    with pytest.raises(TraceFormatError, match=r"vx\.parquet: unreadable trace format version 'two'"):
        read_trace(path)


def test_other_format(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    with pytest.raises(TraceFormatError, match=r"plain\.parquet: not a verl_ext\.trace file"):
        read_trace(plain)
    other = write_table(good_table(), tmp_path / "other.parquet", {b"verl_ext.trace.format": b"someone.else"})
    with pytest.raises(TraceFormatError, match=r"other\.parquet: format 'someone\.else' is not 'verl_ext\.trace'"):
        read_trace(other)


def test_corrupt_meta(tmp_path):
    path = write_table(good_table(), tmp_path / "m.parquet", {b"verl_ext.trace.meta": b"{not json"})
    with pytest.raises(TraceFormatError, match=r"m\.parquet: corrupt trace metadata"):
        read_trace(path)


def test_missing_column(tmp_path):
    path = write_table(good_table(), tmp_path / "c.parquet", drop="response_ids")
    with pytest.raises(TraceFormatError, match=r"c\.parquet: missing column\(s\) \['response_ids'\]"):
        read_trace(path)


def test_null_and_wrong_types(tmp_path):
    t = good_table()
    col = t.column("prompt_uid").to_pylist()
    col[3] = None
    bad = t.set_column(t.schema.get_field_index("prompt_uid"), pa.field("prompt_uid", pa.string()), pa.array(col))
    with pytest.raises(TraceFormatError, match=r"n\.parquet: column 'prompt_uid' has 1 null value"):
        read_trace(write_table(bad, tmp_path / "n.parquet"))
    bad = t.set_column(t.schema.get_field_index("epoch"), "epoch", pa.array(["x"] * len(t)))
    with pytest.raises(TraceFormatError, match=r"w\.parquet: column 'epoch' has type string"):
        read_trace(write_table(bad, tmp_path / "w.parquet"))


def test_token_id_out_of_range_in_file(tmp_path):
    t = good_table()
    ids = t.column("response_ids").to_pylist()
    ids[1] = [5, 2**31]
    bad = t.set_column(t.schema.get_field_index("response_ids"), "response_ids", pa.array(ids, type=pa.list_(pa.int64())))
    with pytest.raises(TraceFormatError, match=r"big\.parquet: response_ids has token id 2147483648 outside \[0, 2\*\*31\)"):
        read_trace(write_table(bad, tmp_path / "big.parquet"))
    ids[1] = [-1]
    bad = t.set_column(t.schema.get_field_index("response_ids"), "response_ids", pa.array(ids, type=pa.list_(pa.int64())))
    with pytest.raises(TraceFormatError, match=r"neg\.parquet: response_ids has token id -1"):
        read_trace(write_table(bad, tmp_path / "neg.parquet"))


def test_token_times_count_mismatch_in_file(tmp_path):
    t = good_table()
    times = t.column("token_times").to_pylist()
    row = next(i for i, x in enumerate(times) if len(x) > 1)
    times[row] = times[row][:-1]
    bad = t.set_column(t.schema.get_field_index("token_times"), "token_times", pa.array(times, type=pa.large_list(pa.float32())))
    with pytest.raises(TraceFormatError, match=rf"tt\.parquet: token_times of row {row} has \d+ entries; expected 0 \(unknown\) or one per"):
        read_trace(write_table(bad, tmp_path / "tt.parquet"))


def rebuilt(t: Trace, **changes) -> Trace:
    """A trace from ``t``'s flat arrays with some of the constructor's arguments changed."""
    kw = {name: getattr(t, name) for name in (
        "epoch", "step", "prompt_uid", "sample_index", "prompt_tokens", "prompt_offsets", "response_tokens",
        "response_offsets", "reward", "finish_reason", "instance", "submit_s", "finish_s", "token_times",
        "token_time_offsets", "meta")}
    return Trace(**{**kw, **changes})


def test_bad_in_memory_traces(tmp_path):
    t = Trace.from_rows(make_rows())
    assert_same(rebuilt(t), t)
    with pytest.raises(ValueError, match="read-only"):  # the token lists are immutable views
        t.response_offsets[3] = 0
    # malformed offsets: the constructor refuses them (a trace cannot hold them)
    ro = t.response_offsets.copy()
    ro[3] = ro[2] - 1
    with pytest.raises(TraceFormatError, match=r"in-memory trace: response_ids offsets decrease at row"):
        rebuilt(t, response_offsets=ro)
    with pytest.raises(TraceFormatError, match=r"prompt_ids offsets have shape \(12,\), expected \(13,\)"):
        rebuilt(t, prompt_offsets=t.prompt_offsets[:-1])
    ro = t.response_offsets.copy()
    ro[-1] += 1
    with pytest.raises(TraceFormatError, match="response_ids offsets end at"):
        rebuilt(t, response_offsets=ro)
    with pytest.raises(TraceFormatError, match="token_times and token_time_offsets must both be set"):
        rebuilt(t, token_time_offsets=None)
    # per-row columns may be edited; validate (and so write_trace) checks them
    t.reward = t.reward[:-1]
    with pytest.raises(TraceFormatError, match=r"column 'reward' has shape \(11,\), expected \(12,\)"):
        t.validate()
    with pytest.raises(TraceFormatError, match=r"column 'reward' has shape"):
        write_trace(t, tmp_path / "x.parquet")  # write validates first
    assert not (tmp_path / "x.parquet").exists()
    t = Trace.from_rows(make_rows())
    t.finish_reason[2] = "eos"
    with pytest.raises(TraceFormatError, match=r"row 2 has finish_reason 'eos'; valid: \['stop', 'length', 'abort'\]"):
        t.validate()
    t = Trace.from_rows(make_rows())
    t.meta = {"x": object()}
    with pytest.raises(TraceFormatError, match="meta is not JSON-serialisable"):
        t.validate()
    rows = make_rows()
    rows[0]["prompt_ids"] = [2**31]
    with pytest.raises(TraceFormatError, match=r"prompt_ids has token id 2147483648 outside \[0, 2\*\*31\)"):
        Trace.from_rows(rows)
    rows = make_rows()
    del rows[1]["finish_reason"]
    with pytest.raises(TraceFormatError, match="row is missing key 'finish_reason'"):
        Trace.from_rows(rows)


# -- speed --------------------------------------------------------------------------------------------
def test_large_trace_is_fast(tmp_path):
    n, length = 10_000, 1_000
    rng = np.random.default_rng(0)
    ro = np.arange(n + 1, dtype=np.int64) * length
    po = np.arange(n + 1, dtype=np.int64) * 100
    t = Trace(
        epoch=np.zeros(n), step=np.zeros(n), prompt_uid=[f"u{i // 8}" for i in range(n)], sample_index=np.arange(n) % 8,
        prompt_tokens=rng.integers(0, 49152, po[-1]).astype(np.int32), prompt_offsets=po,
        response_tokens=rng.integers(0, 49152, ro[-1]).astype(np.int32), response_offsets=ro,
        reward=np.ones(n), finish_reason=["stop"] * n, instance=["vllm-0"] * n, submit_s=np.zeros(n), finish_s=np.ones(n),
    )
    path = tmp_path / "big.parquet"
    write_trace(t, path)  # warm-up (imports)
    best_write = best_read = float("inf")
    for _ in range(3):  # best of three: the machine may be shared
        t0 = time.perf_counter()
        write_trace(t, path)
        t1 = time.perf_counter()
        back = read_trace(path)
        t2 = time.perf_counter()
        best_write, best_read = min(best_write, t1 - t0), min(best_read, t2 - t1)
    np.testing.assert_array_equal(back.response_tokens, t.response_tokens)
    np.testing.assert_array_equal(back.response_offsets, t.response_offsets)
    # ~0.15 s each on an idle core; the bound leaves room for a loaded CI machine
    assert best_write < 2.0 and best_read < 2.0, (best_write, best_read)


# -- the committed real trace ------------------------------------------------------------------------------
def test_committed_trace():
    assert COMMITTED.is_file(), f"{COMMITTED} is missing"
    assert COMMITTED.stat().st_size < 5e6
    t = read_trace(COMMITTED)  # validates
    assert t.meta["source"] == "real" and t.meta["model"] == "SmolLM2-135M-Instruct"
    assert t.epochs() == [0, 1] and (t.step == t.epoch).all()
    assert len(t) == 2 * 64 * 8
    for e in (0, 1):
        s = t.select(t.epoch == e)
        uids = sorted(set(s.prompt_uid.tolist()))
        assert len(uids) == 64
        for uid in uids:
            assert sorted(s.sample_index[s.prompt_uid == uid].tolist()) == list(range(8))
    # the same prompts in both epochs
    first = {u: t.prompt(i).tolist() for i, u in enumerate(t.prompt_uid) if t.epoch[i] == 0}
    assert all(first[u] == t.prompt(i).tolist() for i, u in enumerate(t.prompt_uid) if t.epoch[i] == 1)
    lengths = t.response_lengths()
    assert lengths.max() <= 384 and lengths.min() >= 1
    assert ((t.finish_reason == "length") == (lengths == 384)).all()
    assert set(t.finish_reason.tolist()) <= {"stop", "length"}
    assert set(np.unique(t.reward).tolist()) <= {0.0, 1.0}
    assert set(t.instance.tolist()) == {"vllm-0", "vllm-1"}
    assert np.isfinite(t.submit_s).all() and (t.finish_s >= t.submit_s).all()
    assert t.token_times is not None
    np.testing.assert_array_equal(t.token_time_offsets, t.response_offsets)  # per token, every row
    last = t.token_times[t.token_time_offsets[1:] - 1]  # last token's arrival ~ finish - submit
    assert (last <= (t.finish_s - t.submit_s) + 1e-3).all()
