"""History workers: Ray actors on idle CPUs that hold the rollout history (RhymeRL
section 4.2 "history workers", section 5.3 "Resources").

``HistoryWorker`` wraps one shard's ``HistoryStore`` (``verl_ext.history.store``). Prompts are
sharded by a stable hash of their uid (``shard_of``, the same hash as the grouped draft server's).
Each actor asks Ray for ``num_cpus`` CPUs only (no GPU) and lowers its own OS priority
(``os.nice``) so that it cannot starve trainer or engine processes; where the platform allows it,
``cpu_affinity`` pins it to given cores.

Checkpoints: ``checkpoint()`` writes the shard's snapshot atomically (temporary file, then
rename) to ``<checkpoint_dir>/history-<shard>-of-<shards>.vxh``. A worker (re)starts from that file
when it exists: after a trainer restart, or when Ray restarts a dead actor. A corrupt file is
logged, counted (``restore_failures``) and set aside as ``*.corrupt``; the worker starts empty.

``HistoryClient`` is the driver side: it starts (or finds, by name) the shards, routes each call to
them and never lets a worker failure reach the rollout. A failed or timed-out call logs one
warning, counts ``failures`` and returns "no history" (no drafts, no lengths); Ray restarts the
actor (``max_restarts``) from its last checkpoint, and later calls reach the new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from verl_ext.history.store import HistoryCorrupt, HistoryStore, Trajectory
from verl_ext.sharding import shard_of

logger = logging.getLogger(__name__)

ACTOR_PREFIX = "verl_ext_history"


def checkpoint_path(directory: str, shard: int, num_shards: int) -> Path:
    return Path(directory) / f"history-{shard}-of-{num_shards}.vxh"


class HistoryWorker:
    """One shard of the rollout history (a Ray actor; plain object in tests)."""

    def __init__(self, shard: int = 0, num_shards: int = 1, keep: int = 1, max_bytes: int = 1 << 30,
                 checkpoint_dir: Optional[str] = None, nice: int = 10, cpu_affinity: Optional[Sequence[int]] = None):
        self.shard = shard
        self.num_shards = num_shards
        self.checkpoint_dir = checkpoint_dir
        self.m = {"restored": 0, "restore_failures": 0, "restore_s": 0.0, "checkpoints": 0, "checkpoint_s": 0.0,
                  "checkpoint_bytes": 0, "ingest_s": 0.0, "serve_s": 0.0}
        self.store = HistoryStore(keep=keep, max_bytes=max_bytes)
        self._lower_priority(nice, cpu_affinity)
        self._restore()

    @staticmethod
    def _lower_priority(nice: int, cpu_affinity: Optional[Sequence[int]]) -> None:
        if nice:
            try:
                os.nice(int(nice))
            except (OSError, AttributeError) as exc:  # not permitted / not POSIX: run as is
                logger.info("history worker: os.nice(%s) not applied (%s)", nice, exc)
        if cpu_affinity:
            try:
                os.sched_setaffinity(0, set(int(c) for c in cpu_affinity))
            except (OSError, AttributeError, ValueError) as exc:
                logger.warning("history worker: cpu_affinity %s not applied (%s)", list(cpu_affinity), exc)

    def _path(self) -> Optional[Path]:
        if not self.checkpoint_dir:
            return None
        return checkpoint_path(self.checkpoint_dir, self.shard, self.num_shards)

    def _restore(self) -> None:
        path = self._path()
        if path is None or not path.exists():
            return
        t = time.perf_counter()
        try:
            self.store = HistoryStore.loads(path.read_bytes(), max_bytes=self.store.max_bytes)
            self.m["restored"] += 1
        except (HistoryCorrupt, OSError) as exc:
            self.m["restore_failures"] += 1
            bad = path.with_suffix(path.suffix + ".corrupt")
            try:
                os.replace(path, bad)
            except OSError:
                bad = path
            logger.warning("history shard %d: checkpoint %s unreadable (%s); starting with no history "
                           "(file kept as %s)", self.shard, path, exc, bad)
        self.m["restore_s"] = time.perf_counter() - t

    # -- the actor's API ----------------------------------------------------------------------------
    def ping(self) -> int:
        return os.getpid()

    def ingest(self, rows: list) -> int:
        """``rows``: (uid, step, sample, response token bytes (int32) or list, reward) tuples."""
        t = time.perf_counter()
        n = self.store.ingest(Trajectory(u, s, j, _ids(toks), r) for u, s, j, toks, r in rows)
        self.m["ingest_s"] += time.perf_counter() - t
        return n

    def close_step(self, step: int) -> list:
        return self.store.close_step(step)

    def serve(self, uids: Sequence[str], step: Optional[int] = None) -> dict:
        """{uid: ([int32 token bytes], [weights])} for the prompts with history before ``step``."""
        t = time.perf_counter()
        out = {}
        for u in uids:
            toks, ws = self.store.serve(u, step)
            if toks:
                out[str(u)] = ([x.tobytes() for x in toks], ws)
        self.m["serve_s"] += time.perf_counter() - t
        return out

    def lengths(self, uids: Sequence[str], step: Optional[int] = None) -> dict:
        return self.store.lengths(uids, step)

    def growth_rates(self, step: Optional[int] = None) -> list:
        return self.store.growth_rates(step)

    def checkpoint(self) -> dict:
        path = self._path()
        if path is None:
            return {}
        t = time.perf_counter()
        blob = self.store.dumps()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        self.m["checkpoints"] += 1
        self.m["checkpoint_s"] = time.perf_counter() - t
        self.m["checkpoint_bytes"] = len(blob)
        return {"path": str(path), "bytes": len(blob), "seconds": self.m["checkpoint_s"]}

    def stats(self) -> dict:
        return {**self.store.stats(), **self.m, "pid": os.getpid()}


def _ids(toks) -> np.ndarray:
    if isinstance(toks, (bytes, bytearray, memoryview)):
        return np.frombuffer(toks, dtype=np.int32)
    return np.asarray(toks, dtype=np.int32)


class HistoryClient:
    """Driver-side access to the history shards. Every method degrades to "no history" on failure."""

    def __init__(self, num_shards: int = 1, keep: int = 1, max_bytes: int = 1 << 30,
                 checkpoint_dir: Optional[str] = None, num_cpus: float = 1.0, nice: int = 10,
                 timeout_s: float = 30.0, max_restarts: int = 3, namespace_prefix: str = ACTOR_PREFIX,
                 handles: Optional[list] = None):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0 (history workers take CPUs only), got {num_cpus}")
        self.num_shards = num_shards
        self.worker_args = dict(num_shards=num_shards, keep=keep, max_bytes=max_bytes,
                                checkpoint_dir=checkpoint_dir, nice=nice)
        self.num_cpus = num_cpus
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.prefix = namespace_prefix
        self.shards: list = list(handles) if handles is not None else []
        self.m = {"failures": 0, "ingested": 0, "served_prompts": 0, "served_tokens": 0}
        self._warned: set = set()

    def start(self) -> "HistoryClient":
        """Start or find the named shard actors (``<prefix>_<shard>``)."""
        if self.shards:
            return self
        import ray

        if not ray.is_initialized():
            raise RuntimeError("HistoryClient.start() needs Ray: call ray.init() first, or pass handles")
        actor = ray.remote(HistoryWorker)
        for i in range(self.num_shards):
            self.shards.append(
                actor.options(name=f"{self.prefix}_{i}", get_if_exists=True, num_cpus=self.num_cpus, num_gpus=0,
                              max_restarts=self.max_restarts, max_task_retries=0, lifetime=None)
                .remote(shard=i, **self.worker_args)
            )
        return self

    # -- routing --------------------------------------------------------------------------------
    def shard(self, uid: str) -> int:
        return shard_of(str(uid), self.num_shards)

    def _by_shard(self, uids: Iterable[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = defaultdict(list)
        for u in uids:
            out[self.shard(u)].append(str(u))
        return out

    async def _call(self, what: str, shard: int, ref):
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RayActorError, ActorUnavailableError, timeouts, ...
            self.m["failures"] += 1
            key = (what, shard)
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("history worker %d: %s failed (%s: %s); going on without history for it "
                               "(Ray restarts the worker from its last checkpoint)", shard, what,
                               type(exc).__name__, str(exc)[:200] or "no answer within %.0f s" % self.timeout_s)
            return None

    async def ingest(self, trajectories: Iterable[Trajectory]) -> int:
        rows: dict[int, list] = defaultdict(list)
        for t in trajectories:
            toks = np.asarray(t.response_ids, dtype=np.int32).tobytes()
            rows[self.shard(t.uid)].append((str(t.uid), int(t.step), int(t.sample), toks,
                                           None if t.reward is None else float(t.reward)))
        res = await asyncio.gather(*(self._call("ingest", i, self.shards[i].ingest.remote(r)) for i, r in rows.items()))
        n = sum(x for x in res if x)
        self.m["ingested"] += n
        return n

    async def close_step(self, step: int) -> list[float]:
        res = await asyncio.gather(*(self._call("close_step", i, s.close_step.remote(step)) for i, s in enumerate(self.shards)))
        return [x for r in res if r for x in r]

    async def serve(self, uids: Iterable[str], step: Optional[int] = None) -> dict:
        """{uid: ([int32 arrays], [weights])}; prompts on a failed shard have no history."""
        groups = self._by_shard(uids)
        res = await asyncio.gather(*(self._call("serve", i, self.shards[i].serve.remote(u, step)) for i, u in groups.items()))
        out = {}
        for r in res:
            for uid, (blobs, ws) in (r or {}).items():
                out[uid] = ([np.frombuffer(b, dtype=np.int32) for b in blobs], list(ws))
                self.m["served_tokens"] += sum(len(b) // 4 for b in blobs)
        self.m["served_prompts"] += len(out)
        return out

    async def lengths(self, uids: Iterable[str], step: Optional[int] = None) -> dict:
        """{uid: (median, max)} of the prompts with history before ``step``."""
        groups = self._by_shard(uids)
        res = await asyncio.gather(*(self._call("lengths", i, self.shards[i].lengths.remote(u, step)) for i, u in groups.items()))
        out = {}
        for r in res:
            out.update({k: tuple(v) for k, v in (r or {}).items()})
        return out

    async def growth_percentile(self, q: float = 75.0, step: Optional[int] = None) -> Optional[float]:
        res = await asyncio.gather(*(self._call("growth_rates", i, s.growth_rates.remote(step)) for i, s in enumerate(self.shards)))
        rates = [x for r in res if r for x in r]
        return float(np.percentile(rates, q)) if rates else None

    async def checkpoint(self) -> list[dict]:
        res = await asyncio.gather(*(self._call("checkpoint", i, s.checkpoint.remote()) for i, s in enumerate(self.shards)))
        return [r for r in res if r]

    async def stats(self) -> dict:
        res = await asyncio.gather(*(self._call("stats", i, s.stats.remote()) for i, s in enumerate(self.shards)))
        total: dict = defaultdict(float)
        for r in res:
            for k, v in (r or {}).items():
                if isinstance(v, (int, float)) and k != "pid":
                    total[k] += v
        return dict(total)

    def metrics(self) -> dict:
        return dict(self.m)

    async def stop(self) -> None:
        import ray

        for s in self.shards:
            try:
                ray.kill(s, no_restart=True)
            except Exception:  # already gone
                pass
        self.shards = []

