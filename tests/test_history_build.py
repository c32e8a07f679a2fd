"""History trees built off the drafting thread (verl_ext.spec.history_build and the native
build_history / install_history): the same drafts as trees built in place, a build that runs
beside the drafting thread, and payloads applied in order without a stall or a lost tree."""

import threading
import time

import numpy as np
import pytest

from verl_ext.spec._suffix import DraftIndex, build_history


def _drafts(idx, ctx, k=6):
    idx.start_request("r", np.asarray(ctx, dtype=np.int32), history="p", scopes=4)
    draft, scope = idx.propose("r", k, min_match=2, min_prob=0.0)
    idx.finish("r")
    return list(draft[0]), scope


def test_built_tree_drafts_like_a_tree_built_in_place():
    rng = np.random.default_rng(0)
    responses = [rng.integers(0, 50, size=n).astype(np.int32) for n in (200, 150, 90)]
    weights = [1.0, 0.5, 2.0]
    a, b = DraftIndex(32, 0, 8), DraftIndex(32, 0, 8)
    for r, w in zip(responses, weights):
        a.add_history("p", r, w)
    tree = build_history(32, responses, weights)
    assert tree.tokens == sum(map(len, responses)) and tree.bytes > 0 and not tree.installed
    b.install_history("p", tree)
    assert tree.installed and tree.tokens == 0
    for r in responses:
        for at in (5, 40, 80):
            assert _drafts(a, r[:at]) == _drafts(b, r[:at])
    sa, sb = a.stats(), b.stats()
    assert (sa["histories"], sa["tokens"], sa["nodes"], sa["bytes"]) == (sb["histories"], sb["tokens"], sb["nodes"], sb["bytes"])
    b.install_history("p", build_history(32, [responses[0][:10]], [1.0]))  # replaces, bytes follow
    assert b.stats()["histories"] == 1 and b.stats()["tokens"] == 10 and b.stats()["bytes"] < sb["bytes"]


def test_build_and_install_refuse_bad_input():
    idx = DraftIndex(32, 0, 8)
    with pytest.raises(ValueError, match="one weight per response"):
        build_history(32, [[1, 2]], [])
    with pytest.raises(ValueError, match="weight"):
        build_history(32, [[1, 2]], [-1.0])
    with pytest.raises(ValueError, match="negative token"):
        build_history(32, [np.asarray([1, -2], dtype=np.int32)], [1.0])
    with pytest.raises(ValueError, match="max_depth"):
        build_history(1, [[1, 2]], [1.0])
    with pytest.raises(ValueError, match="depth 16 differs"):
        idx.install_history("p", build_history(16, [[1, 2]], [1.0]))
    tree = build_history(32, [[1, 2, 3]], [1.0])
    idx.install_history("p", tree)
    with pytest.raises(ValueError, match="already installed"):
        idx.install_history("q", tree)
    assert idx.stats()["histories"] == 1


def test_a_build_runs_beside_the_drafting_thread():
    """The build holds no GIL: the drafting thread keeps proposing while a large tree builds.
    With the GIL held through the build, the drafting thread could not run until it ended (a
    handful of proposals, one pause as long as the build); held through part of it, one pause as
    long as that part. The pause is compared with the same build's own duration, not with a build
    timed alone, so that a machine whose other core is busy (CI) slows both sides alike."""
    rng = np.random.default_rng(1)
    responses = [rng.integers(0, 1000, size=100_000).astype(np.int32) for _ in range(20)]
    idx = DraftIndex(64, 0, 8)
    idx.add_history("p", responses[0][:5000], 1.0)
    idx.start_request("r", responses[0][:100], history="p", scopes=4)
    span = {}

    def build():
        span["start"] = time.perf_counter()
        build_history(64, responses, [1.0] * 20)
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=build)
    stamps = []
    worker.start()
    while worker.is_alive():
        idx.propose("r", 8, min_match=2, min_prob=0.0)
        stamps.append(time.perf_counter())
    worker.join()
    during = np.asarray([t for t in stamps if span["start"] <= t <= span["end"]])
    build_s = span["end"] - span["start"]
    edges = np.concatenate([[span["start"]], during, [span["end"]]])
    longest = float(np.diff(edges).max())
    assert during.size > 100 and longest < build_s / 2, (build_s, longest, during.size)


def _gated(monkeypatch):
    """Hold every build until the returned event is set (the real native build runs then)."""
    import verl_ext.spec.history_build as hb

    gate, real = threading.Event(), hb.build_history

    def build(*a):
        assert gate.wait(30)
        return real(*a)

    monkeypatch.setattr(hb, "build_history", build)
    return gate


def test_drafter_applies_payloads_in_order_and_keeps_the_old_tree_until_the_new_one_is_in(monkeypatch):
    from _util import ProposerBatch, make_proposer

    p = make_proposer(scopes="history", k=4, min_match=2, min_prob=0.0)
    old, new = list(range(100, 140)), list(range(300, 340))
    assert p.rpc("set_histories", [("q", [old], [1.0]), ("r", [old], [1.0])]) == 2
    assert p.rpc("await_histories") == 2
    gate = _gated(monkeypatch)
    t = time.perf_counter()
    packed = np.asarray(new, dtype=np.int32).tobytes()
    assert p.rpc("set_histories", [("q", [packed], [1.0])], ["r"]) == 1  # returns while the build waits
    assert time.perf_counter() - t < 5
    b = ProposerBatch(p)
    b.add("a", [1] + old[:3], "g", history="q")
    b.add("c", [1] + old[:3], "h", history="r")
    d = b.step()  # the new tree is not built: q drafts from its old tree, r is not dropped yet
    assert d["a"] == old[3:7] and d["c"] == old[3:7]
    st = p.rpc("stats")
    assert st["history_builds_pending"] == 1 and st["histories"] == 2
    gate.set()
    assert p.rpc("await_histories") == 1
    b.finish("a")
    b.finish("c")
    b.add("x", [1] + old[:3], "g2", history="q")
    b.add("y", [1] + new[:3], "h2", history="q")
    b.add("z", [1] + old[:3], "h3", history="r")
    d = b.step()
    assert not d.get("x") and d["y"] == new[3:7] and not d.get("z")  # q replaced, r dropped
    st = p.rpc("stats")
    assert st["histories"] == 1 and st["history_builds_pending"] == 0 and st["history_trees_built"] == 3


def test_a_draft_step_installs_what_is_built_without_waiting(monkeypatch):
    from _util import ProposerBatch, make_proposer

    p = make_proposer(scopes="history", k=4, min_match=2, min_prob=0.0)
    hist = list(range(100, 140))
    p.rpc("set_histories", [("q", [hist], [1.0])])
    deadline = time.monotonic() + 30
    while p.history_builds.pending and time.monotonic() < deadline:  # built on its own thread
        time.sleep(0.01)
    b = ProposerBatch(p)
    b.add("a", [1] + hist[:3], "g", history="q")
    assert b.step()["a"] == hist[3:7]  # the step swapped the tree in; no await_histories


def test_a_bad_prompt_costs_its_own_tree_only():
    from _util import make_proposer

    p = make_proposer(scopes="history", k=4)
    bad = np.asarray([1, -5, 3], dtype=np.int32).tobytes()
    assert p.rpc("set_histories", [("ok", [[1, 2, 3]], [1.0]), ("bad", [bad], [1.0]), ("ok2", [[4, 5]], [1.0])]) == 3
    assert p.rpc("await_histories") == 2
    st = p.rpc("stats")
    assert st["histories"] == 2 and st["history_build_errors"] == 1
    with pytest.raises(ValueError, match="2 responses and 1 weights"):  # malformed: the RPC fails
        p.rpc("set_histories", [("q", [[1], [2]], [1.0])])
    assert p.rpc("stats")["history_builds_pending"] == 0


def test_direct_history_edits_wait_for_queued_builds(monkeypatch):
    """``drop_history`` after a queued ``set_histories`` of the same key drops the new tree: the
    build is applied first, never after."""
    from _util import make_proposer

    p = make_proposer(scopes="history", k=4)
    gate = _gated(monkeypatch)
    p.rpc("set_histories", [("q", [[1, 2, 3]], [1.0])])
    threading.Timer(0.2, gate.set).start()
    assert p.rpc("drop_history", "q") is True
    assert p.rpc("stats")["histories"] == 0
