"""The drafter's operations (``verl_ext.engine.drafter_ops``): every one survives its wire form,
bad ones fail with the operation named, and results come back typed. Each operation against a
real proposer: test_history_build, test_dgds, test_specactor, test_rhyme; on real engines:
test_spec_engine, test_seer_engine."""

import dataclasses

import msgspec
import pytest

from verl_ext.engine import drafter_ops as ops


def _example(cls):
    values = {"key": "p", "responses": [b"\x01\x00\x00\x00"], "weights": [1.0], "items": [("p", [[1, 2]], [1.0])],
              "drop": ["q"], "timeout_s": 5.0, "blobs": [b"x"], "groups": ["g"], "enabled": True,
              "windows": {"r": 2}, "request_ids": ["r"], "tokens": True}
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", list(ops.OPS.values()), ids=list(ops.OPS))
def test_every_operation_survives_vllms_wire(cls):
    op = _example(cls)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(op.wire()))  # what collective_rpc carries, no pickle
    assert wire[0] == cls.name and ops.from_wire(wire[0], wire[1:]) == cls(*wire[1:])
    assert dataclasses.astuple(ops.from_wire(wire[0], wire[1:])) == tuple(wire[1:])


def test_bad_operations_name_themselves():
    with pytest.raises(ValueError, match="unknown drafter op 'nope'; valid: add_history"):
        ops.from_wire("nope", ())
    with pytest.raises(ValueError, match="drafter op 'group_counts'"):
        ops.from_wire("group_counts", ())
    with pytest.raises(ValueError, match="group_write needs true or false"):
        ops.from_wire("group_write", ("yes",))
    with pytest.raises(ValueError, match="set_windows needs"):
        ops.SetWindows([("r", 1)])


def test_results_come_back_typed():
    assert ops.GroupCounts(["g"]).result({"g": [1, 3]}) == {"g": ops.GroupCount(closed=1, total=3)}
    got = ops.Progress(["a", "b"], tokens=True).result({"a": [2, 5, [7, 8]], "b": [1, 1]})
    assert got == {"a": ops.RequestProgress(2, 5, [7, 8]), "b": ops.RequestProgress(1, 1, None)}
    assert ops.ImportGroups([b"x", b"y"]).result([3, -1]) == [3, -1]
