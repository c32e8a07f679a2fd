"""The native suffix-tree index against a brute-force reference (tests/_suffix_ref.py) on random
and adversarial sequences: tree contents and priorities, longest matches and drafts, delta
export/import, checkpoints, memory cap, and bad input."""

import random

import numpy as np
import pytest

from _suffix_ref import Reference
from verl_ext.spec import SCOPE_GLOBAL, SCOPE_GROUP, SCOPE_HISTORY, SCOPE_REQUEST, DraftIndex


def _check_draft(ref, ctx, k, draft, min_match, max_match, min_prob):
    tokens, probs, score, match_len = draft
    want = ref.walk_draft(list(ctx), list(map(int, tokens)), k, min_match, max_match, min_prob)
    assert want["ok"], want["why"]
    assert match_len == want["match_len"]
    np.testing.assert_allclose(probs, want["probs"], rtol=1e-5)


def _fill_group(rng, idx, ref, group, vocab, seqs, steps, prefix="s"):
    open_ = {f"{prefix}{i}": [] for i in range(seqs)}
    for _ in range(steps):
        key = rng.choice(sorted(open_))
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        idx.group_append(group, key, toks)
        ref.append(key, toks)
        if rng.random() < 0.03 and len(open_) > 1:
            idx.group_close(group, key)
            ref.close(key)
            del open_[key]


@pytest.mark.parametrize("vocab,depth,seed", [(2, 6, 0), (3, 8, 1), (5, 5, 2), (50, 12, 3), (4, 32, 4)])
def test_group_tree_matches_reference(vocab, depth, seed):
    rng = random.Random(seed)
    idx = DraftIndex(depth, 0, 16)
    ref = Reference(depth)
    _fill_group(rng, idx, ref, "g", vocab, seqs=4, steps=150)
    assert idx.dump(SCOPE_GROUP, "g") == pytest.approx(ref.nodes())
    for _ in range(200):
        u = [rng.randrange(vocab) for _ in range(rng.randint(0, depth))]
        assert idx.priority(SCOPE_GROUP, "g", u) == pytest.approx(ref.prio(u))
    for _ in range(200):
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * depth))]
        k = rng.randint(1, 16)
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, depth + 2)
        min_prob = rng.choice([0.0, 0.0, 0.3])
        d = idx.tree_propose(SCOPE_GROUP, "g", ctx, k, min_match=lo, max_match=hi, min_prob=min_prob)
        _check_draft(ref, ctx, k, d, lo, hi, min_prob)


def test_adversarial_sequences():
    """Periodic runs, one long repeated token, and a sequence that is a prefix of another."""
    idx = DraftIndex(8, 0, 32)
    ref = Reference(8)
    seqs = {"a": [7] * 40, "b": [1, 2] * 20, "c": [1, 2, 3] * 5, "d": [1, 2, 3] * 5 + [4]}
    for key, toks in seqs.items():
        for t in toks:  # token by token, like a decode loop
            idx.group_append("g", key, [t])
            ref.append(key, [t])
    idx.group_close("g", "c")
    ref.close("c")
    assert idx.dump(SCOPE_GROUP, "g") == pytest.approx(ref.nodes())
    for ctx in ([7, 7, 7], [1, 2, 1], [2, 3, 1, 2], [3, 4], [9], [1, 2, 3, 4]):
        d = idx.tree_propose(SCOPE_GROUP, "g", ctx, 32, min_match=1, max_match=7, min_prob=0.0)
        _check_draft(ref, ctx, 32, d, 1, 7, 0.0)
    # a long run drafts past max_depth by re-matching its own tail
    tokens, probs, _, _ = idx.tree_propose(SCOPE_GROUP, "g", [7] * 10, 20, min_match=2, max_match=7, min_prob=0.0)
    assert list(tokens) == [7] * 20


def test_history_priorities_follow_rewards():
    idx = DraftIndex(16, 0, 16)
    ref = Reference(16)
    good, bad = [5, 6, 7, 8, 9], [5, 6, 1, 2, 3]
    for toks, w in ((bad, 1.0), (good, 3.0), (bad, 1.0)):
        idx.add_history("p", toks, w)
        ref.add_closed(toks, w)
    assert idx.dump(SCOPE_HISTORY, "p") == pytest.approx(ref.nodes())
    assert idx.priority(SCOPE_HISTORY, "p", [5, 6]) == pytest.approx(5.0)
    idx.start_request("r", [0, 5, 6], history="p")
    (tokens, probs, _, _), scope = idx.propose("r", 3, scopes=SCOPE_HISTORY, min_match=1)
    assert scope == SCOPE_HISTORY and list(tokens) == [7, 8, 9]  # 3.0 beats 2 x 1.0
    np.testing.assert_allclose(probs, [0.6, 1.0, 1.0])
    with pytest.raises(ValueError, match="weight"):
        idx.add_history("p", [1, 2], -1.0)


@pytest.mark.parametrize("vocab,depth,seed", [(3, 8, 10), (6, 12, 11), (40, 16, 12)])
def test_multi_path_drafts_match_reference_beam(vocab, depth, seed):
    """propose_paths (top-n branches for tree-verifying engines) against the reference beam
    search, on a reward-weighted history tree (non-integer weights, so no ties to break)."""
    rng = random.Random(seed)
    idx = DraftIndex(depth, 0, 16)
    ref = Reference(depth)
    for _ in range(12):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(5, 40))]
        w = rng.uniform(0.1, 2.0)
        idx.add_history("p", toks, w)
        ref.add_closed(toks, w)
    seen_multi = 0
    for _ in range(150):
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, depth))]
        k, n = rng.randint(1, 12), rng.randint(1, 5)
        lo, min_prob = rng.randint(1, 2), rng.choice([0.0, 0.05, 0.3])
        got = idx.propose_paths(SCOPE_HISTORY, "p", ctx, k, n, min_match=lo, max_match=depth, min_prob=min_prob)
        want = ref.beam_paths(ctx, k, lo, depth, min_prob, n)
        assert [list(map(int, t)) for t, _, _, _ in got] == [t for t, _, _ in want], (ctx, k, n)
        for (_, probs, score, match_len), (_, wprobs, wscore) in zip(got, want):
            np.testing.assert_allclose(probs, wprobs, rtol=1e-5)
            assert score == pytest.approx(wscore, rel=1e-5)
            assert match_len == ref.match_len(ctx, lo, depth, min_prob)
        assert len(got) <= n and len({tuple(t) for t, _, _, _ in got}) == len(got)
        seen_multi += len(got) > 1
        if n == 1 and got and len(got[0][0]) < depth - got[0][3]:  # one path is a linear draft
            assert ref.walk_draft(ctx, list(map(int, got[0][0])), k, lo, depth, min_prob)["ok"]
    assert seen_multi > 20  # the test exercises branching, not only single paths
    assert idx.propose_paths(SCOPE_HISTORY, "p", [0], 4, 0) == []
    assert idx.propose_paths(SCOPE_HISTORY, "nope", [0], 4, 3) == []


def test_request_scope_and_batch_propose_agree():
    rng = random.Random(7)
    idx = DraftIndex(16, 0, 8)
    rows = np.zeros((6, 200), dtype=np.int32)
    lens = np.zeros(6, dtype=np.int64)
    keys = [f"r{i}" for i in range(6)]
    for i, key in enumerate(keys):
        prompt = [rng.randrange(6) for _ in range(30)]
        idx.start_request(key, prompt, group="g" if i % 2 else "")
        rows[i, :30] = prompt
        lens[i] = 30
    for step in range(40):
        for i in range(6):
            rows[i, lens[i]] = rng.randrange(6)
            lens[i] += 1
        ks = np.array([rng.randint(0, 8) for _ in keys])
        idx.batch_propose(keys, 0, rows, lens)  # sync every row first: the group tree is shared
        toks, n, probs, scope = idx.batch_propose(keys, ks, rows, lens)
        for i, key in enumerate(keys):
            assert idx.context_length(key) == lens[i]  # the batch call synced the new tokens
            (t1, p1, _, _), s1 = idx.propose(key, int(ks[i]))  # context from the index itself
            assert list(toks[i, : n[i]]) == list(t1) and scope[i] == s1
            assert n[i] <= ks[i] and (toks[i, n[i]:] == -1).all()
    lists = idx.batch_propose_lists(keys, 8, rows, lens)
    assert [len(x) for x in lists] == list(idx.batch_propose(keys, 8, rows, lens)[1])
    assert idx.finish("r1") and not idx.finish("r1")
    assert idx.batch_propose_lists(["r1", "zz"], 4, rows, lens) == [[], []]  # unknown ids: empty drafts


@pytest.mark.parametrize("vocab,seed,depth,max_matches", [(3, 0, 12, (6, 11)), (6, 1, 12, (6, 11)), (40, 2, 12, (6, 11)),
                                                          (6, 3, 64, (6, 40))])
def test_remembered_failed_walks_give_the_proposals_of_a_full_search(vocab, seed, depth, max_matches):
    """A request's proposals skip the context walks that failed at its earlier proposals
    (``WalkMemo``) while their trees grow (siblings writing the group tree, a history tree
    installed half-way). Every proposal equals the one an index built from the same calls
    gives at its first proposal, which searches every match length. At depth 64 the window
    of match lengths changes between 6 and 40, so the memo's slots grow and keep their entries."""
    rng = random.Random(seed)
    log = []  # every call that changes the index, replayed into a fresh one for each check

    def do(idx, op):
        log.append(op)
        op(idx)

    def fresh():
        idx = DraftIndex(depth, 0, 8)
        for op in log:
            op(idx)
        return idx

    keys = [f"r{i}" for i in range(4)]
    rows = {}  # full contexts
    warm = DraftIndex(depth, 0, 8)
    for i, key in enumerate(keys):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]
        do(warm, lambda x, key=key, prompt=prompt: x.start_request(key, prompt, group="g", history="h"))
        rows[key] = list(prompt)
    for step in range(60):
        if step == 25:
            hist = [[rng.randrange(vocab) for _ in range(40)] for _ in range(3)]
            do(warm, lambda x, hist=hist: [x.add_history("h", h, 1.0 + j) for j, h in enumerate(hist)])
        if step % 10 == 9:  # a sibling finishes (its last windows go in at once) and another starts
            gone, new = keys[step % len(keys)], f"r{len(rows)}"
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]
            do(warm, lambda x, gone=gone: x.finish(gone))
            do(warm, lambda x, key=new, prompt=prompt: x.start_request(key, prompt, group="g", history="h"))
            keys[step % len(keys)], rows[new] = new, list(prompt)
        for key in keys:
            toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            rows[key] += toks
            do(warm, lambda x, key=key, toks=toks: x.append(key, toks))
        key = keys[step % len(keys)]
        k = rng.randint(1, 8)
        kw = dict(min_match=rng.choice([1, 2]), max_match=rng.choice(max_matches), min_prob=rng.choice([0.0, 0.3]))
        if step % 2:  # the full context passed in (the vLLM drafter), else the index's own tail
            kw["context"] = rows[key]
        for scopes in (SCOPE_REQUEST, SCOPE_GROUP | SCOPE_HISTORY, 7):
            for other in keys:  # warm every request's memo, including ones not checked this step
                warm.propose(other, k, scopes=scopes, **{**kw, **({"context": rows[other]} if step % 2 else {})})
            cold = fresh()
            assert cold.stats()["walks_skipped"] == 0
            (t1, p1, s1, m1), sc1 = warm.propose(key, k, scopes=scopes, **kw)
            (t2, p2, s2, m2), sc2 = cold.propose(key, k, scopes=scopes, **kw)
            assert (list(t1), list(p1), s1, m1, sc1) == (list(t2), list(p2), s2, m2, sc2)
    assert warm.stats()["walks_skipped"] > 100  # the memo was used, not only kept


def test_a_failed_walk_is_tried_again_once_a_sibling_inserts_its_path():
    idx = DraftIndex(4, 0, 8)
    idx.start_request("a", [1, 2, 3], group="g")
    idx.start_request("b", [0], group="g")
    idx.append("a", [5, 6, 7])
    assert len(idx.propose("a", 2, scopes=SCOPE_GROUP, min_prob=0.0)[0][0]) == 0  # every walk fails
    idx.append("b", [6, 7, 8])
    assert idx.finish("b")  # closing inserts b's last windows: [6 7 8] is a root path now
    (toks, probs, _, match_len), scope = idx.propose("a", 2, scopes=SCOPE_GROUP, min_prob=0.0)
    assert list(toks) == [8] and match_len == 2 and scope == SCOPE_GROUP


def test_sync_rows_and_match_lengths_equal_the_per_request_rules():
    """The simulator's exact replay in batch calls: ``sync_rows`` appends what each request's
    row holds beyond its context, in order, as appending request by request does (the group tree
    and its ticks see the same calls); ``match_lengths`` is the accepted prefix of each draft."""
    from verl_ext.spec._suffix import match_lengths

    rng = np.random.default_rng(3)
    keys = [f"r{i}" for i in range(5)]
    rows = [rng.integers(0, 4, size=300).astype(np.int32) for _ in keys]
    a, b = DraftIndex(16, 0, 8), DraftIndex(16, 0, 8)
    for i, key in enumerate(keys):
        for idx in (a, b):
            idx.start_request(key, rows[i][:20], group="g" if i % 2 else "")
    pos = np.full(len(keys), 20, dtype=np.int64)
    for _ in range(30):
        pos = np.minimum(pos + rng.integers(0, 9, size=len(keys)), 300)
        a.sync_rows(keys, rows, pos)
        for key, row, p in zip(keys, rows, pos.tolist()):
            have = b.context_length(key)
            if have < p:
                b.append(key, row[have:p])
        assert a.save(7) == b.save(7)
        toks, n, _, _ = a.batch_propose(keys, 8)
        limits = np.minimum(n, 300 - pos - 1)
        acc = match_lengths(toks, limits, rows, pos)
        for j, (row, p, m) in enumerate(zip(rows, pos.tolist(), limits.tolist())):
            same = toks[j, :m] == row[p: p + m]
            assert acc[j] == (m if same.all() else int(np.argmin(same)))
    with pytest.raises(ValueError):
        match_lengths(toks, np.full(len(keys), 9), rows, pos)  # past the drafts' width
    with pytest.raises(KeyError):
        a.sync_rows(["nope"], rows[:1], pos[:1])


def test_delta_export_import_equals_rebuild():
    rng = random.Random(11)
    src, dst = DraftIndex(10, 0, 8), DraftIndex(10, 0, 8)
    ref = Reference(10)
    version = 0
    for round_ in range(12):
        _fill_group(rng, src, ref, "g", 4, seqs=3, steps=25, prefix=f"r{round_}-")
        blob, version_new = src.export_group("g", version)
        assert version_new >= version
        dst.import_group(blob)
        version = version_new
        assert dst.dump(SCOPE_GROUP, "g") == src.dump(SCOPE_GROUP, "g")
    full, _ = src.export_group("g", 0)
    rebuilt = DraftIndex(10, 0, 8)
    rebuilt.import_group(full, rename="h")
    assert rebuilt.dump(SCOPE_GROUP, "h") == pytest.approx(ref.nodes()) == src.dump(SCOPE_GROUP, "g")
    # a missing delta is refused and changes nothing
    src.group_append("g", "late", [1, 2, 3])
    first, v1 = src.export_group("g", version)
    src.group_append("g", "late", [4])
    second, _ = src.export_group("g", v1)
    before = dst.dump(SCOPE_GROUP, "g")
    with pytest.raises(ValueError, match="missing delta"):
        dst.import_group(second)
    assert dst.dump(SCOPE_GROUP, "g") == before
    for bad in (b"", b"junk", full[:-3]):
        with pytest.raises(ValueError):
            dst.import_group(bad)
    assert dst.dump(SCOPE_GROUP, "g") == before


def test_checkpoint_roundtrip_and_memory_cap():
    rng = random.Random(5)
    idx = DraftIndex(24, 0, 8)
    for p in range(20):
        for _ in range(4):
            idx.add_history(f"p{p}", [rng.randrange(100) for _ in range(300)], rng.random())
    blob = idx.save()
    other = DraftIndex(24, 0, 8)
    assert other.load(blob) == 20 * 4 * 300
    for p in range(20):
        assert other.dump(SCOPE_HISTORY, f"p{p}") == idx.dump(SCOPE_HISTORY, f"p{p}")
    with pytest.raises(ValueError):
        other.load(blob[:100])
    full = idx.stats()["bytes"]
    capped = DraftIndex(24, full // 4, 8)
    capped.load(blob)
    s = capped.stats()
    assert s["bytes"] <= full // 4 and s["evictions"] > 0 and 0 < s["histories"] < 20
    capped.start_request("r", [1, 2, 3], history="p0")
    capped.propose("r", 4)  # an evicted history drafts nothing, and nothing breaks


def test_memory_per_token_is_compact():
    idx = DraftIndex(32, 0, 8)
    rng = np.random.default_rng(0)
    for g in range(4):
        base = rng.integers(0, 32000, 2000)
        for s in range(8):  # similar responses, 5% of tokens changed
            r = base.copy()
            m = rng.random(len(r)) < 0.05
            r[m] = rng.integers(0, 32000, m.sum())
            idx.group_append(f"g{g}", f"s{s}", r)
    s = idx.stats()
    assert s["bytes"] / s["tokens"] < 64


def test_bad_input_is_rejected_cleanly():
    idx = DraftIndex(8, 0, 4)
    idx.start_request("r", [1, 2, 3, 1, 2], group="g")
    before = idx.dump(SCOPE_REQUEST, "r")
    for bad, msg in (([-1], "outside"), ([2**31], "outside"), (np.array([1.5]), "integer"), ([[1], [2]], "one-dimensional"),
                     (np.array([2**40], dtype=np.uint64), "outside int32"), (["a"], "integer")):
        with pytest.raises(ValueError, match=msg):
            idx.append("r", bad)
    assert idx.dump(SCOPE_REQUEST, "r") == before and idx.context_length("r") == 5
    with pytest.raises(ValueError, match="max_draft"):
        idx.propose("r", 5)
    with pytest.raises(ValueError, match="max_draft"):
        idx.batch_propose(["r"], [5])
    with pytest.raises(ValueError, match="max_draft"):
        idx.propose("r", -1)
    assert len(idx.propose("r", 0)[0][0]) == 0
    assert len(idx.propose("r", 3, context=[])[0][0]) == 0
    assert len(idx.propose("nobody", 3)[0][0]) == 0
    with pytest.raises(KeyError, match="unknown request"):
        idx.append("nobody", [1])
    with pytest.raises(ValueError, match="already active"):
        idx.start_request("r", [1])
    with pytest.raises(KeyError):
        idx.dump(SCOPE_GROUP, "nope")
    with pytest.raises(ValueError, match="max_depth"):
        DraftIndex(1, 0, 4)
    with pytest.raises(ValueError, match="row width"):
        idx.batch_propose(["r"], [2], np.zeros((1, 4), np.int32), [9])


def test_group_write_false_reads_but_never_writes_the_group_tree():
    idx = DraftIndex(8, 0, 8)
    sibling = [5, 6, 7, 8, 9, 10, 11, 12]
    idx.group_append("g", "other", sibling)
    before = idx.dump(SCOPE_GROUP, "g")
    v0 = idx.group_version("g")
    idx.start_request("r", [1, 2, 5, 6], group="g", scopes=SCOPE_GROUP, group_write=False)
    assert idx.group_counts("g") == (0, 1)  # no sequence added for r
    tokens, _, _, _ = idx.propose("r", 4)[0]
    assert list(tokens) == [7, 8, 9, 10]  # reads the group tree
    idx.append("r", [7, 8, 9])
    assert idx.finish("r")
    assert idx.dump(SCOPE_GROUP, "g") == before and idx.group_version("g") == v0
    assert idx.group_counts("g") == (0, 1) and idx.group_sequence("g", "r") == (0, False)
    # a group that does not exist yet is not created, and is read once it is imported
    idx.start_request("q", [5, 6], group="new", scopes=SCOPE_GROUP, group_write=False)
    assert idx.group_counts("new") == (0, 0) and idx.stats()["groups"] == 1
    assert len(idx.propose("q", 4)[0][0]) == 0
    src = DraftIndex(8, 0, 8)
    src.group_append("new", "a", sibling)
    idx.import_group(src.export_group("new", 0)[0])
    assert list(idx.propose("q", 3)[0][0]) == [7, 8, 9]
    idx.append("q", [7])
    assert idx.group_sequence("new", "a") == (8, False) and idx.group_counts("new") == (0, 1)
    # the default still writes
    idx.start_request("w", [1, 2], group="g")
    idx.append("w", [3, 4])
    assert idx.group_sequence("g", "w") == (2, False) and idx.group_counts("g") == (0, 2)
    idx.finish("w")
    assert idx.group_sequence("g", "w") == (2, True) and idx.group_counts("g") == (1, 2)


def test_chunks_of_a_response_write_one_named_sequence_that_merges_with_its_import():
    """group_seq/group_offset: a response's chunks (engine requests of their own) continue one
    group sequence named by the response, and a draft server's copy of the same response merges
    into it: one sequence, not the chunks' fragments plus a second copy."""
    idx = DraftIndex(8, 0, 8)
    resp = list(range(10, 30))
    idx.start_request("c0", [1, 2], group="g", scopes=SCOPE_GROUP, group_seq="resp", group_offset=0)
    idx.append("c0", resp[:8])
    idx.finish("c0")  # the response may go on: left open for its import to close
    assert idx.group_counts("g") == (0, 1) and idx.group_sequence("g", "resp") == (8, False)
    idx.start_request("c1", [1, 2, *resp[:8]], group="g", scopes=SCOPE_GROUP, group_seq="resp", group_offset=8)
    idx.append("c1", resp[8:12])
    assert idx.group_sequence("g", "resp") == (12, False)
    # the server's copy, ahead of the engine and closed: merged, not added
    server = DraftIndex(8, 0, 8)
    server.group_append("g", "resp", resp[:16])
    server.group_close("g", "resp")
    assert idx.import_group(server.export_group("g", 0)[0]) == 4
    assert idx.group_counts("g") == (1, 1) and idx.group_sequence("g", "resp") == (16, True)
    idx.append("c1", resp[12:18])  # already there, or past the close: nothing written
    assert idx.group_sequence("g", "resp") == (16, True)
    idx.finish("c1")
    # an import ahead of an open sequence: the chunk appends only what it lacks
    idx.start_request("d0", [1], group="g", scopes=SCOPE_GROUP, group_seq="other", group_offset=0)
    idx.append("d0", [1, 2, 3])
    src = DraftIndex(8, 0, 8)
    src.group_append("g", "other", [1, 2, 3, 4, 5])
    idx.import_group(src.export_group("g", 0)[0])
    idx.append("d0", [4, 5, 6, 7])
    assert idx.dump(SCOPE_GROUP, "g") == _dump_of({"resp": (resp[:16], True), "other": ([1, 2, 3, 4, 5, 6, 7], False)})
    # a continuation on an engine that lacks the response's start writes a sequence of its own
    idx.start_request("e1", [1], group="g", scopes=SCOPE_GROUP, group_seq="gap", group_offset=5)
    idx.append("e1", [9, 9])
    assert idx.group_sequence("g", "gap") == (0, False) and idx.group_sequence("g", "e1") == (2, False)
    # a second live writer of a named sequence (a copy of the response) writes its own
    idx.start_request("d1", [1], group="g", scopes=SCOPE_GROUP, group_seq="other", group_offset=7)
    idx.append("d1", [8])
    assert idx.group_sequence("g", "other") == (7, False) and idx.group_sequence("g", "d1") == (1, False)
    idx.finish("d0")
    idx.start_request("d2", [1], group="g", scopes=SCOPE_GROUP, group_seq="other", group_offset=7)
    idx.append("d2", [8])
    assert idx.group_sequence("g", "other") == (8, False)


def _dump_of(seqs):
    """The group dump of an index built from ``{name: (tokens, closed)}``."""
    ref = DraftIndex(8, 0, 8)
    for name, (toks, closed) in seqs.items():
        ref.group_append("g", name, toks)
        if closed:
            ref.group_close("g", name)
    return ref.dump(SCOPE_GROUP, "g")


def test_group_counts_and_versions():
    idx = DraftIndex(8, 0, 8)
    assert idx.group_counts("nope") == (0, 0) and idx.group_version("nope") == 0
    for i in range(4):
        idx.group_append("g", f"s{i}", [1, 2, 3])
    assert idx.group_counts("g") == (0, 4)
    idx.group_close("g", "s1")
    idx.group_close("g", "s3")
    assert idx.group_counts("g") == (2, 4)
    _, v = idx.export_group("g", 0)
    assert idx.group_version("g") == v > 0
    idx.group_append("g", "s0", [4])
    assert idx.group_version("g") > v
    dst = DraftIndex(8, 0, 8)
    dst.import_group(idx.export_group("g", 0)[0])
    assert dst.group_counts("g") == (2, 4)  # closed flags travel with the deltas
    assert dst.group_sequence("g", "s0") == (4, False) and dst.group_sequence("g", "s1") == (3, True)
    idx.drop_group("g")
    assert idx.group_counts("g") == (0, 0)


def test_delta_without_its_base_tree_is_refused():
    src, dst = DraftIndex(8, 0, 8), DraftIndex(8, 0, 8)
    src.group_append("g", "a", [1, 2, 3, 4])
    full, v = src.export_group("g", 0)
    src.group_append("g", "b", [5, 6])  # only a new sequence since v
    delta, _ = src.export_group("g", v)
    with pytest.raises(ValueError, match="missing delta"):
        dst.import_group(delta)  # would leave a tree without "a"
    assert dst.group_counts("g") == (0, 0)
    dst.import_group(full)
    assert dst.import_group(delta) == 2 and dst.dump(SCOPE_GROUP, "g") == src.dump(SCOPE_GROUP, "g")


def test_global_scope_is_off_until_set_and_bounded_by_two_generations():
    idx = DraftIndex(8, 0, 8)
    with pytest.raises(RuntimeError, match="global scope is off"):
        idx.add_global([1, 2, 3])
    idx.start_request("q", [9, 9], group="", scopes=SCOPE_GLOBAL)
    idx.append("q", [1, 2])
    assert len(idx.propose("q", 4, scopes=SCOPE_GLOBAL, min_prob=0.0)[0][0]) == 0
    idx.set_global_tokens(10)
    assert idx.global_tokens == 10
    idx.add_global([1, 2, 3, 4, 5, 6])
    (toks, _, _, match_len), scope = idx.propose("q", 4, scopes=SCOPE_GLOBAL, min_prob=0.0)
    assert list(toks) == [3, 4, 5, 6] and match_len == 2 and scope == SCOPE_GLOBAL
    assert len(idx.tree_propose(SCOPE_GLOBAL, "old", [1, 2], 4, min_prob=0.0)[0]) == 0  # no older tree yet
    idx.add_global([7] * 6)  # the newer tree reached 12 >= 10 tokens: the next response rotates
    idx.add_global([8] * 6)
    assert list(idx.tree_propose(SCOPE_GLOBAL, "old", [1, 2], 4, min_prob=0.0)[0]) == [3, 4, 5, 6]
    assert idx.stats()["global_tokens_held"] == 18
    # both generations are drafted from: [1 2] continues in the older tree
    assert list(idx.propose("q", 4, scopes=SCOPE_GLOBAL, min_prob=0.0)[0][0]) == [3, 4, 5, 6]
    idx.add_global([5] * 5)
    idx.add_global([6] * 5)  # rotates again: the tree with [1 .. 6] is dropped
    assert idx.stats()["global_tokens_held"] == 16
    assert len(idx.propose("q", 4, scopes=SCOPE_GLOBAL, min_prob=0.0)[0][0]) == 0
    # a finished request's response goes in, whatever scopes it drafted from
    idx.start_request("r", [4, 4, 4], group="g", scopes=SCOPE_REQUEST)
    idx.append("r", [1, 2, 3, 1, 2, 7])
    before = idx.stats()["global_tokens_held"]
    assert idx.finish("r") and idx.stats()["global_tokens_held"] == before + 6
    assert list(idx.propose("q", 4, scopes=SCOPE_GLOBAL, min_prob=0.0)[0][0])[:1] in ([3], [7])
    assert len(idx.propose("q", 4, scopes=SCOPE_REQUEST | SCOPE_GROUP, min_prob=0.0)[0][0]) == 0  # only with its bit
    full = idx.stats()["bytes"]
    idx.set_global_tokens(0)  # off: both trees dropped, their memory released
    assert idx.stats()["global_tokens_held"] == 0 and idx.stats()["bytes"] < full
    with pytest.raises(ValueError):
        idx.set_global_tokens(-1)
    with pytest.raises(ValueError):
        idx.tree_propose(SCOPE_GLOBAL, "newest", [1, 2], 4)


@pytest.mark.parametrize("weights", [False, True])
def test_scope_weights_turn_to_the_scope_whose_drafts_the_response_contains(weights):
    """The group tree is sure [1 2] goes on with 3 4; the history tree gives 9 9 half the time;
    the response keeps going on with 9 9. By score the group's draft wins every time; weighed by
    how each scope's drafts fared (``scope_weights``), the history's wins once the group's
    first drafts have failed."""
    idx = DraftIndex(8, 0, 4)
    idx.group_append("g", "sib", [1, 2, 3, 4, 5] * 6)
    idx.add_history("p", [1, 2, 9, 9, 6, 1, 2, 8, 8, 6], 1.0)
    idx.start_request("r", [7, 7], group="g", history="p")
    idx.append("r", [1, 2])
    scopes = []
    for _ in range(6):
        (toks, _, _, _), scope = idx.propose("r", 2, scopes=SCOPE_GROUP | SCOPE_HISTORY, min_prob=0.0,
                                             scope_weights=weights)
        scopes.append(scope)
        idx.append("r", [9, 9, 1, 2])
    assert scopes[0] == SCOPE_GROUP
    assert scopes[-1] == (SCOPE_HISTORY if weights else SCOPE_GROUP)
    assert idx.stats()["scope_stats"] == int(weights)
    assert idx.drop_group("g") and idx.stats()["scope_stats"] == 0
