"""History workers (RhymeRL sections 4.2, 5.3): the per-prompt store, its statistics,
snapshots, and the Ray actors' checkpoint/restore and failure handling."""

import asyncio
import logging

import numpy as np
import pytest

from verl_ext.history.store import HistoryCorrupt, HistoryStore, Trajectory, history_weight
from verl_ext.history.worker import HistoryClient, HistoryWorker, checkpoint_path


def _traj(uid, step, lengths, rewards=None, base=0):
    rewards = rewards or [1.0] * len(lengths)
    return [Trajectory(uid, step, j, list(range(base + j, base + j + n)), r)
            for j, (n, r) in enumerate(zip(lengths, rewards))]


def test_serve_gives_earlier_steps_only_and_keeps_last_rollouts():
    st = HistoryStore(keep=1)
    st.ingest(_traj("p", 1, [3, 5]))
    assert st.serve("p", step=1) == ([], [])  # a step never drafts from its own responses
    toks, ws = st.serve("p", step=2)
    assert [t.tolist() for t in toks] == [[0, 1, 2], [1, 2, 3, 4, 5]]
    assert ws == [1.1, 1.1]
    st.ingest(_traj("p", 2, [4], base=100))
    st.ingest(_traj("p", 3, [2], base=200))  # keep=1: step 1 is gone, step 2 is history, 3 is open
    assert [t.tolist() for t in st.serve("p", step=3)[0]] == [[100, 101, 102, 103]]
    assert [t.tolist() for t in st.serve("p", step=4)[0]] == [[200, 201]]
    assert st.counters["evicted_rollouts"] == 1
    st.ingest(_traj("p", 1, [9]))  # older than everything kept
    assert st.counters["stale"] == 1
    assert st.serve("unknown", step=9) == ([], [])


def test_keep_two_rollouts():
    st = HistoryStore(keep=2)
    for s in (1, 2, 3):
        st.ingest(_traj("p", s, [s]))
    assert [len(t) for t in st.serve("p", step=3)[0]] == [1, 2]
    assert [len(t) for t in st.serve("p", step=4)[0]] == [2, 3]


def test_weights_are_reward_aware():
    assert history_weight(1.0) == pytest.approx(1.1)
    assert history_weight(0.0) == pytest.approx(0.1)
    assert history_weight(-3.0) == pytest.approx(0.1)
    assert history_weight(float("nan")) == pytest.approx(0.1)
    assert history_weight(None) == pytest.approx(0.1)


def test_length_statistics_and_growth():
    st = HistoryStore(keep=1)
    st.ingest(_traj("a", 1, [10, 20, 30, 40]))
    st.ingest(_traj("b", 1, [100, 100]))
    st.close_step(1)
    assert st.growth_rates() == []  # no earlier rollout to grow from
    assert st.median_length("a", step=2) == 25.0
    assert st.max_length("a", step=2) == 40
    # (median, max, median of samples 0 and 2, of samples 1 and 3)
    assert st.lengths(["a", "b", "c"], step=2) == {"a": (25.0, 40, 20.0, 30.0), "b": (100.0, 100, 100.0, 100.0)}
    assert st.median_length("a", step=1) is None
    st.ingest(_traj("a", 2, [44, 10]))
    st.ingest(_traj("b", 2, [50, 200]))
    assert sorted(st.close_step(2)) == [pytest.approx(1.1), pytest.approx(2.0)]
    assert st.growth_percentile(75) == pytest.approx(np.percentile([1.1, 2.0], 75))
    assert st.growth_percentile(75, step=2) is None  # only step 2's rates exist


def test_memory_cap_evicts_least_recently_ingested():
    st = HistoryStore(keep=1, max_bytes=4 * 25)
    st.ingest(_traj("old", 1, [10]))
    st.ingest(_traj("mid", 1, [10]))
    st.ingest(_traj("new", 1, [10]))
    assert "old" not in st.prompts and set(st.prompts) == {"mid", "new"}
    assert st.bytes <= st.max_bytes
    assert st.stats()["tokens_held"] == 20
    assert st.stats()["capped_prompts"] == 1  # "old": its whole history dropped by the cap
    roomy = HistoryStore(keep=1)
    for step in (1, 2, 3):  # newer rollouts replacing older ones are not the cap's doing
        roomy.ingest(_traj("p", step, [10]))
    assert roomy.stats()["evicted_rollouts"] == 1 and roomy.stats()["capped_prompts"] == 0


def test_an_epoch_of_dapo_history_needs_several_shards(tmp_path):
    """DAPO-17K x 16 responses x 8k tokens (int32) is 8.9 GB: nine 1 GiB shards hold it; a
    dataset that needs more than the most ``auto`` starts does not fit, nor one that cannot be
    read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_ext.history.capacity import MAX_AUTO_SHARDS, dataset_prompts, epoch_history_bytes, plan_shards

    need = epoch_history_bytes(17_000, 16, 8192)
    assert need == 17_000 * 16 * 8192 * 4 and 8.9e9 < need < 9.0e9
    assert plan_shards(need, 1 << 30) == (9, True)
    assert plan_shards(need, 1 << 28) == (MAX_AUTO_SHARDS, False)
    assert plan_shards(None, 1 << 30) == (1, False)
    assert plan_shards(epoch_history_bytes(10, 2, 8), 1 << 30) == (1, True)
    files = []
    for i, n in enumerate((7, 5)):
        f = tmp_path / f"train{i}.parquet"
        pq.write_table(pa.table({"prompt": [f"p{j}" for j in range(n)]}), f)
        files.append(str(f))
    assert dataset_prompts(files) == 12 and dataset_prompts(files[0]) == 7
    assert dataset_prompts(files, max_samples=10) == 10 and dataset_prompts(files, max_samples=-1) == 12
    assert dataset_prompts(["hdfs://cluster/train.parquet"]) is None and dataset_prompts(None) is None


def test_snapshot_round_trip_and_corruption():
    st = HistoryStore(keep=2)
    st.ingest(_traj("p", 1, [3, 4], rewards=[1.0, None]))
    st.ingest(_traj("q", 1, [5]))
    st.close_step(1)
    st.ingest(_traj("p", 2, [6]))
    st.close_step(2)
    blob = st.dumps()
    back = HistoryStore.loads(blob)
    for uid in ("p", "q"):
        for step in (2, 3):
            a, b = st.serve(uid, step), back.serve(uid, step)
            assert [x.tolist() for x in a[0]] == [x.tolist() for x in b[0]] and a[1] == b[1]
    assert back.growth_rates() == st.growth_rates() and back.bytes == st.bytes
    assert back.prompts["p"].rollouts[0].rewards == [1.0, None]
    bad = bytearray(blob)
    bad[-5] ^= 0xFF
    with pytest.raises(HistoryCorrupt, match="checksum"):
        HistoryStore.loads(bytes(bad))
    with pytest.raises(HistoryCorrupt, match="magic"):
        HistoryStore.loads(blob[:10])
    with pytest.raises(HistoryCorrupt, match="version"):
        HistoryStore.loads(blob[:6] + (99).to_bytes(4, "little") + blob[10:])


def test_worker_checkpoint_restore_and_corrupt_file(tmp_path, caplog):
    w = HistoryWorker(shard=0, num_shards=1, checkpoint_dir=str(tmp_path), nice=0)
    w.ingest([("p", 1, 0, np.arange(7, dtype=np.int32).tobytes(), 1.0)])
    info = w.checkpoint()
    assert info["bytes"] > 0
    w2 = HistoryWorker(shard=0, num_shards=1, checkpoint_dir=str(tmp_path), nice=0)
    assert w2.stats()["restored"] == 1
    assert [np.frombuffer(b, np.int32).tolist() for b in w2.serve(["p"], 2)["p"][0]] == [list(range(7))]
    path = checkpoint_path(str(tmp_path), 0, 1)
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    with caplog.at_level(logging.WARNING):
        w3 = HistoryWorker(shard=0, num_shards=1, checkpoint_dir=str(tmp_path), nice=0)
    assert w3.stats()["restore_failures"] == 1 and w3.serve(["p"], 2) == {}
    assert "unreadable" in caplog.text
    assert path.with_suffix(".vxh.corrupt").exists() and not path.exists()


def test_history_feeds_the_draft_index():
    """What a worker serves is what the engine's drafter loads: a history draft follows."""
    from verl_ext.spec import SCOPE_HISTORY, DraftIndex

    st = HistoryStore()
    st.ingest([Trajectory("p", 1, 0, [5, 6, 7, 8, 9, 10, 11], 1.0), Trajectory("p", 1, 1, [5, 6, 7, 1, 2], 0.0)])
    idx = DraftIndex(32, 0, 8)
    for toks, w in zip(*st.serve("p", step=2)):
        idx.add_history("p", toks, w)
    idx.start_request("r", np.asarray([1, 5, 6, 7], np.int32), history="p", scopes=SCOPE_HISTORY)
    draft, scope = idx.propose("r", 4, scopes=SCOPE_HISTORY, min_prob=0.0)
    assert list(draft[0])[:2] == [8, 9]  # the rewarded branch wins
    assert scope == SCOPE_HISTORY


async def test_client_shards_and_survives_a_killed_worker(ray_session, tmp_path, caplog):
    ray = ray_session
    client = HistoryClient(num_shards=2, checkpoint_dir=str(tmp_path), num_cpus=0.5, timeout_s=20.0,
                           namespace_prefix="test_history_kill").start()
    try:
        uids = [f"p{i}" for i in range(8)]
        shards = {client.shard(u) for u in uids}
        assert shards == {0, 1}
        trajs = [t for u in uids for t in _traj(u, 1, [3, 4 + int(u[1:])])]
        assert await client.ingest(trajs) == 16
        assert (await client.lengths(uids, step=2))["p5"] == (6.0, 9, 3.0, 9.0)
        assert len((await client.serve(uids, step=2))["p3"][0]) == 2
        assert len(await client.checkpoint()) == 2
        await client.ingest(_traj("late", 2, [5]))  # after the checkpoint: lost with the worker
        victim = client.shard("p0")
        pid = await client.shards[victim].ping.remote()
        ray.kill(client.shards[victim], no_restart=False)
        with caplog.at_level(logging.WARNING):
            served = await client.serve(uids, step=2)
            for _ in range(100):  # Ray restarts the actor from its checkpoint
                served = await client.serve(uids, step=2)
                if all(u in served for u in uids):
                    break
                await asyncio.sleep(0.2)
        assert all(u in served for u in uids), "the restarted worker did not restore its checkpoint"
        assert client.metrics()["failures"] >= 1 and "going on without history" in caplog.text
        assert await client.shards[victim].ping.remote() != pid
        stats = await client.stats()
        assert stats["restored"] >= 1
    finally:
        await client.stop()


def test_history_workers_load_without_the_native_index_and_shard_like_the_draft_server():
    """The history workers need only the shared hash (``verl_ext.sharding``), not the compiled
    draft index; the grouped draft server places a key on the same shard."""
    import subprocess
    import sys

    code = ("import sys, verl_ext.history.worker as w; "
            "print(int('verl_ext.spec._suffix' in sys.modules), int('verl_ext.spec.dgds' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0"]
    from verl_ext.sharding import shard_of
    from verl_ext.spec.dgds import shard_of as dgds_shard_of

    keys = [f"prompt-{i}" for i in range(64)]
    assert [shard_of(k, 4) for k in keys] == [dgds_shard_of(k, 4) for k in keys]
    assert len({shard_of(k, 4) for k in keys}) == 4 and shard_of("x", 1) == 0


def test_auto_shards_hold_an_epoch_or_say_why_not(tmp_path, caplog):
    """``history.shards: auto`` (the default) inside veRL: as many shards as the trainer's dataset,
    ``rollout.n`` and ``data.max_response_length`` need, with a warning where they cannot."""
    pytest.importorskip("verl")
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from verl_ext.config.settings import VerlExtSettings
    from verl_ext.rollout.manager import _with_history_shards

    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [f"p{j}" for j in range(1000)]}), data)

    def shards(max_bytes, files):
        settings = VerlExtSettings.from_custom({"verl_ext": {"strategy": "rhyme", "history": {"max_bytes": max_bytes}}})
        assert settings.history.shards == "auto"
        config = OmegaConf.create({"data": {"train_files": files, "max_response_length": 1024},
                                   "actor_rollout_ref": {"rollout": {"n": 8, "response_length": 1024}}})
        return _with_history_shards(settings, config).history.shards

    need = 1000 * 8 * 1024 * 4  # 32.8 MB
    with caplog.at_level(logging.WARNING, logger="verl_ext.rollout.manager"):
        assert shards(need // 3 + 1, [str(data)]) == 3 and not caplog.records
        assert shards(need // 100, [str(data)]) == 16
        assert "prompts will lose their history before their next epoch" in caplog.text
        caplog.clear()
        assert shards(1 << 30, ["hdfs://x/train.parquet"]) == 1 and "cannot size an epoch's history" in caplog.text
    with pytest.raises(Exception, match="shards must be an integer >= 1 or auto"):
        VerlExtSettings.from_custom({"verl_ext": {"strategy": "rhyme", "history": {"shards": "many"}}})


async def test_the_dispatcher_warns_once_when_a_shard_drops_a_prompts_history(caplog):
    import types

    pytest.importorskip("verl")
    from verl_ext.config.settings import HistorySettings
    from verl_ext.rollout.dispatcher import StrategyDispatcher

    class _History:
        num_shards, capped = 2, 0

        async def stats(self):
            return {"capped_prompts": self.capped, "bytes_held": 3 << 30}

    d = types.SimpleNamespace(history=_History(), settings=types.SimpleNamespace(history=HistorySettings()),
                              _capped_prompts=0, _warned_cap=False)
    with caplog.at_level(logging.WARNING, logger="verl_ext.rollout.dispatcher"):
        await StrategyDispatcher._check_history_cap(d)
        assert not caplog.records and d._capped_prompts == 0
        d.history.capped = 5
        await StrategyDispatcher._check_history_cap(d)
        d.history.capped = 9
        await StrategyDispatcher._check_history_cap(d)
    assert d._capped_prompts == 9
    assert [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()] == [
        "verl_ext: the history shards dropped 5 prompts' history to stay under 2 x 1.00 GiB (history.shards x "
        "history.max_bytes; 3.00 GiB held): those prompts come back without HistoSpec drafts or HistoPipe lengths; "
        "raise history.max_bytes or history.shards"]
