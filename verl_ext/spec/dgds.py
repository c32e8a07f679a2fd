"""Distributed Grouped Draft Server (DGDS): Seer's shared group suffix trees (§4.4, §5).

Seer (§4.4) keeps one compressed suffix tree per prompt group on a draft server that
aggregates the responses of every request of the group, wherever they run, and lets each
inference instance speculate from a local copy. Its workflow has four steps, mapped here:

1. *Asynchronous append*: the tokens each request generates are sent with their group id, in
   batches of several tokens per request to cut communication (``DGDSClient.append`` buffers a
   sequence until it has ``append_every`` new tokens or the next sync tick, then one
   ``GroupDraftServer.append`` call per shard carries every buffered sequence).
2. *Global aggregation* with request-id isolation: the server appends each update to its
   group's tree, under the request's own sequence (keyed by request id), so tokens of different
   requests never run into one another's paths (``DraftIndex.group_append``).
3. *Periodic incremental fetch*: each instance gets, every ``sync_interval_s``, only the groups
   it currently runs (``serve``/``unserve``), and only what changed since its last copy
   (``GroupDraftServer.fetch`` returns ``DraftIndex.export_group`` deltas since the instance's
   versions; importing is idempotent on overlapping tokens).
4. *Local speculation*: the engine's drafter (``verl_ext.vllm.proposer``) imports the
   deltas (``VLLMInstance.import_drafts``) and drafts from its local copy; with
   ``SpecOptions(group_source="remote")`` its own requests do not also write the local group
   trees (the server's copy already has their tokens).

Seer §5 deploys several servers to spread communication and storage; the client routes a group
to shard ``shard_of(group, num_shards)`` (a stable hash: blake2b of the group id, the same in
every process, unlike Python's ``hash``).

The servers are Ray actors (``num_cpus=0``). DGDS affects drafts only, never outputs: when a
shard dies, or its calls have answered later than ``timeout_s`` for ``stall_s`` in a row (at
least ``SLOW_CALLS_BEFORE_DEGRADE`` calls; a late answer on a loaded host only skips that tick:
Ray still runs the call, in order), the client logs one warning, reports ``degraded=1`` and
stops syncing; the engines keep drafting from their request trees and the group trees they
already imported. No client method raises into the rollout (``start`` raises only when Ray is
not initialised and no actor handles were given) and every Ray wait is bounded.

Sequence keys: the client's ``seq`` names a response in the server's tree and, after import, in
the engine's; a request that restarts from scratch with different tokens needs a new key
(appends are checked by offset, not content). The group key must be the ``group_id`` string the
engine sees (``str(GenRequest.group_id)``) so that the engine's requests find the imported tree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from verl_ext.sharding import shard_of
from verl_ext.spec._suffix import DraftIndex

logger = logging.getLogger(__name__)

__all__ = ["DGDSClient", "GroupDraftServer", "import_deltas", "shard_of"]

Update = tuple  # (group, seq, start, tokens, closed)


def import_deltas(index: DraftIndex, blobs) -> list[int]:
    """Import group delta ``blobs`` into ``index``: tokens applied per blob, -1 for a blob the index
    refuses (e.g. a delta against a tree it evicted: the server resends it in full)."""
    out = []
    for blob in blobs:
        try:
            out.append(int(index.import_group(bytes(blob))))
        except (ValueError, KeyError, RuntimeError, MemoryError):
            out.append(-1)
    return out


def _tokens(tokens) -> np.ndarray:
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return np.frombuffer(tokens, dtype=np.int32)
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


class GroupDraftServer:
    """One DGDS shard: the group trees of the groups hashed to it (plain class; the client makes
    it a Ray actor). Not thread-safe: run it as a default (single-threaded) actor.

    ``max_depth`` is the server tree's depth (its own index only; importers build their trees
    with their own depth from the same sequences). ``max_bytes`` 0: no eviction (an evicted tree
    would lose sequences the clients hold deltas against); ``drop`` groups when done instead.
    """

    def __init__(self, max_depth: int = 32, max_bytes: int = 0):
        self.index = DraftIndex(int(max_depth), int(max_bytes), 1)
        self._appends = self._fetches = self._updates = 0
        self._tokens = self._skipped = self._bytes_out = 0
        self._gaps = self._errors = 0

    def ping(self) -> bool:
        return True

    def append(self, updates: Iterable[Update]) -> dict:
        """Apply ``(group, seq, start, tokens, closed)`` updates in order. ``tokens``: int32 bytes
        or a list of ints, the sequence's tokens from offset ``start``. Idempotent: tokens the
        server already has are skipped. A gap (``start`` past the stored length) or a bad update
        is reported in the result (``gaps``/``errors``), never raised, and changes nothing for
        that update. Returns counts: ``tokens`` applied, ``skipped``, ``gaps``, ``errors``."""
        applied = skipped = 0
        gaps: list[tuple[str, str, int, int]] = []
        errors: list[tuple[str, str, str]] = []
        n_updates = 0
        for group, seq, start, tokens, closed in updates:
            n_updates += 1
            group, seq, start = str(group), str(seq), int(start)
            try:
                toks = _tokens(tokens)
                have, is_closed = self.index.group_sequence(group, seq)
                if start > have:
                    gaps.append((group, seq, have, start))
                    continue
                skip = have - start
                if skip < len(toks):
                    if is_closed:
                        raise ValueError(f"append to closed sequence '{seq}'")
                    self.index.group_append(group, seq, toks[skip:])
                    applied += len(toks) - skip
                skipped += min(skip, len(toks))
                if closed and not is_closed:
                    if self.index.group_sequence(group, seq)[0] == 0:
                        self.index.group_append(group, seq, toks[:0])  # an empty response still counts
                    self.index.group_close(group, seq)
            except (ValueError, KeyError, TypeError, RuntimeError, MemoryError) as exc:
                errors.append((group, seq, str(exc)))
        self._appends += 1
        self._updates += n_updates
        self._tokens += applied
        self._skipped += skipped
        self._gaps += len(gaps)
        self._errors += len(errors)
        return {"tokens": applied, "skipped": skipped, "gaps": gaps, "errors": errors}

    def fetch(self, since: dict) -> dict:
        """``{group: version}`` -> ``{group: (delta blob, new version)}`` for the groups that changed
        after ``version`` (0: everything). Unknown and unchanged groups are left out."""
        out = {}
        for group, v in since.items():
            group, v = str(group), int(v)
            now = self.index.group_version(group)
            if now == 0 or now == v:
                continue
            if v > now:  # a copy of a tree that was dropped and rebuilt: start over
                v = 0
            blob, version = self.index.export_group(group, v)
            out[group] = (blob, version)
            self._bytes_out += len(blob)
        self._fetches += 1
        return out

    def drop(self, groups: Iterable[str]) -> int:
        """Forget ``groups`` (e.g. at the end of a rollout iteration); returns how many existed."""
        return sum(bool(self.index.drop_group(str(g))) for g in groups)

    def stats(self) -> dict:
        s = self.index.stats()
        return {
            "groups": s["groups"],
            "tokens": s["tokens"],
            "bytes": s["bytes"],
            "append_calls": self._appends,
            "updates": self._updates,
            "appended_tokens": self._tokens,
            "skipped_tokens": self._skipped,
            "gaps": self._gaps,
            "errors": self._errors,
            "fetch_calls": self._fetches,
            "bytes_out": self._bytes_out,
        }


@dataclass
class _Seq:
    group: str
    seq: str
    start: int  # offset of buf[0]: tokens before it were sent
    buf: list = field(default_factory=list)
    close: bool = False  # close requested, not yet sent
    broken: bool = False  # a gap in the client's own stream: no more sends


#: Failed imports in a row after which an instance's pushes pause, and the first and the longest
#: pause in seconds (doubling while the failures go on; a success resets it).
PAUSE_AFTER_FAILS = 3
PAUSE_S = (1.0, 30.0)
#: Server calls in a row that answer later than ``timeout_s``, and for how long (seconds from
#: the first of them), before the client degrades (a dead shard degrades it at once). Process
#: start-up on a loaded host (engines and workers importing torch on two cores) keeps a live
#: shard late for several seconds; a hung one stays late.
SLOW_CALLS_BEFORE_DEGRADE = 3
STALL_S = 30.0


@dataclass
class _Served:
    instance: Any
    groups: dict = field(default_factory=dict)  # group -> refcount
    versions: dict = field(default_factory=dict)  # group -> version the instance holds
    fails: int = 0  # consecutive failed imports
    paused_until: float = 0.0  # time.monotonic() before which nothing is pushed here
    pause_s: float = 0.0  # the last pause, doubled at each pause in a row


class _Lat:
    def __init__(self, n: int = 20000):
        self.ms = deque(maxlen=n)

    def add(self, seconds: float) -> None:
        self.ms.append(seconds * 1e3)

    def summary(self, prefix: str) -> dict:
        a = np.asarray(self.ms, dtype=np.float64)
        if a.size == 0:
            return {f"{prefix}_ms_mean": 0.0, f"{prefix}_ms_p99": 0.0}
        return {f"{prefix}_ms_mean": float(a.mean()), f"{prefix}_ms_p99": float(np.percentile(a, 99))}


class DGDSClient:
    """The front end's DGDS client (asyncio; call it from the event loop's thread).

    ``start()`` creates ``num_shards`` ``GroupDraftServer`` actors (or uses ``handles``) and a sync
    loop that, every ``sync_interval_s``: sends the buffered appends (one call per shard) and, for
    each instance, fetches the deltas of the groups it serves and pushes them with ``await
    instance.import_drafts(blobs)`` (instances without that method are skipped). ``append``,
    ``close``, ``serve`` and ``unserve`` are cheap, synchronous and never raise.
    """

    def __init__(
        self,
        num_shards: int = 1,
        append_every: int = 16,
        sync_interval_s: float = 0.05,
        timeout_s: float = 2.0,
        handles: Optional[Sequence[Any]] = None,
        max_depth: int = 32,
        start_timeout_s: float = 60.0,
        stall_s: float = STALL_S,
    ):
        if handles is not None:
            handles = list(handles)
            if not handles:
                raise ValueError("DGDSClient: handles is empty")
            num_shards = len(handles)
        if num_shards < 1:
            raise ValueError(f"DGDSClient: num_shards must be >= 1, got {num_shards}")
        if append_every < 1:
            raise ValueError(f"DGDSClient: append_every must be >= 1, got {append_every}")
        if sync_interval_s <= 0 or timeout_s <= 0:
            raise ValueError("DGDSClient: sync_interval_s and timeout_s must be > 0")
        if stall_s < 0:
            raise ValueError(f"DGDSClient: stall_s must be >= 0, got {stall_s}")
        self.num_shards = int(num_shards)
        self.append_every = int(append_every)
        self.sync_interval_s = float(sync_interval_s)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.stall_s = float(stall_s)
        self.max_depth = int(max_depth)
        self._given = handles
        self._shards: list = []
        self._owned = False
        self._seqs: dict[tuple[str, str], _Seq] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._served: dict[int, _Served] = {}
        self._task: Optional[asyncio.Task] = None
        self._wake: Optional[asyncio.Event] = None
        self._lock: Optional[asyncio.Lock] = None  # one flush at a time (appends stay in order)
        self._sync_lock: Optional[asyncio.Lock] = None  # one fetch/push round at a time
        self._urgent = False
        self._stopping = False
        self._started = False
        self._degraded = False
        self._slow_in_row = 0
        self._slow_since = 0.0  # when the first call of the current run of late answers was sent
        self._append_lat, self._fetch_lat, self._import_lat = _Lat(), _Lat(), _Lat()
        # import_failures: group deltas an engine refused (resent in full next time);
        # import_errors: import calls that failed or timed out (the same deltas are retried);
        # import_pauses: times an instance's pushes paused after PAUSE_AFTER_FAILS errors in a row
        self._m = dict(
            failures=0, syncs=0, append_calls=0, updates=0, tokens=0, append_bytes=0, fetch_calls=0,
            bytes_synced=0, blobs=0, imports=0, import_failures=0, import_errors=0, import_pauses=0, gaps=0,
            server_errors=0, dropped_tokens=0, slow_calls=0,
        )
        self._sync_bytes = deque(maxlen=20000)

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Create (or adopt) the shard actors and start the sync loop. Raises ``RuntimeError``
        when Ray is not initialised and no handles were given; a shard that does not answer
        within ``start_timeout_s`` degrades the client instead of raising."""
        if self._started:
            return
        import ray

        if self._given is None:
            if not ray.is_initialized():
                raise RuntimeError("DGDSClient.start() needs Ray: call ray.init() first, or pass actor handles")
            actor = ray.remote(GroupDraftServer).options(num_cpus=0, max_restarts=0, max_task_retries=0)
            self._shards = [actor.remote(max_depth=self.max_depth) for _ in range(self.num_shards)]
            self._owned = True
        else:
            self._shards = list(self._given)
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._sync_lock = asyncio.Lock()
        self._started = True
        await self._call("start", [s.ping.remote() for s in self._shards], self.start_timeout_s)
        if not self._degraded:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dgds-sync")

    async def stop(self, flush: bool = True) -> None:
        """Stop the loop (bounded), optionally sending the last buffered appends, and kill the
        shard actors this client created."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), 2 * self.timeout_s + self.sync_interval_s)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()
        if flush and self._started and not self._degraded:
            await self.flush()
        if self._owned:
            import ray

            for s in self._shards:
                try:
                    ray.kill(s)
                except Exception:  # already dead
                    pass
            self._owned = False
        self._shards = []
        self._started = False

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def handles(self) -> list:
        return list(self._shards)

    # -- instances and groups --------------------------------------------------------------
    def serve(self, instance, group: str) -> None:
        """``instance`` now runs a request of ``group`` (reference-counted)."""
        s = self._served.get(id(instance))
        if s is None:
            s = self._served[id(instance)] = _Served(instance)
        group = str(group)
        s.groups[group] = s.groups.get(group, 0) + 1

    def unserve(self, instance, group: str) -> None:
        """One request of ``group`` left ``instance``; at zero the group is no longer synced there."""
        s = self._served.get(id(instance))
        group = str(group)
        if s is None or group not in s.groups:
            return
        s.groups[group] -= 1
        if s.groups[group] <= 0:
            del s.groups[group]
            s.versions.pop(group, None)  # a later serve refetches in full (imports are idempotent)
            if not s.groups:
                del self._served[id(instance)]

    def served(self, instance) -> dict:
        s = self._served.get(id(instance))
        return dict(s.groups) if s else {}

    # -- appends ---------------------------------------------------------------------------
    def append(self, group: str, seq: str, offset: int, tokens) -> None:
        """Tokens ``tokens`` of response ``seq`` of ``group``, starting at token ``offset`` of that
        response. Overlaps with tokens already given are skipped; a gap stops that sequence."""
        if self._degraded or self._stopping or not self._started:
            return
        key = (str(group), str(seq))
        s = self._seqs.get(key)
        if s is None:
            s = self._seqs[key] = _Seq(key[0], key[1], int(offset))
        if s.broken or s.close:
            return
        end = s.start + len(s.buf)
        offset = int(offset)
        if offset > end:
            s.broken = True
            s.buf.clear()
            self._m["gaps"] += 1
            logger.debug("DGDS: gap in %s/%s (have %d, got offset %d); not syncing it further", *key, end, offset)
            return
        skip = end - offset
        n = len(tokens)
        if skip >= n:
            return
        s.buf.extend(tokens[skip:] if skip else tokens)
        self._dirty.add(key)
        if len(s.buf) >= self.append_every and not self._urgent:
            self._urgent = True
            self._wake.set()

    def close(self, group: str, seq: str) -> None:
        """Response ``seq`` of ``group`` finished (sent with its last tokens)."""
        if self._degraded or self._stopping or not self._started:
            return
        key = (str(group), str(seq))
        s = self._seqs.get(key)
        if s is None:
            s = self._seqs[key] = _Seq(key[0], key[1], 0)
        if s.broken:
            return
        s.close = True
        self._dirty.add(key)

    async def drop(self, groups: Iterable[str]) -> None:
        """Forget ``groups`` on the servers and in the client (e.g. after a rollout iteration)."""
        groups = [str(g) for g in groups]
        gs = set(groups)
        for key in [k for k in self._seqs if k[0] in gs]:
            self._seqs.pop(key, None)
            self._dirty.discard(key)
        for s in self._served.values():
            for g in gs:
                s.versions.pop(g, None)
        if self._degraded or not self._shards:
            return
        by_shard: dict[int, list[str]] = {}
        for g in groups:
            by_shard.setdefault(shard_of(g, self.num_shards), []).append(g)
        await self._call("drop", [self._shards[i].drop.remote(gl) for i, gl in by_shard.items()])

    # -- sync ----------------------------------------------------------------------------------
    async def flush(self) -> None:
        """Send every buffered append now (one call per shard)."""
        if self._degraded or not self._started:
            return
        async with self._lock:
            self._urgent = False
            if not self._dirty:
                return
            per_shard: dict[int, list] = {}
            tokens = nbytes = 0
            for key in self._dirty:
                s = self._seqs.get(key)
                if s is None or s.broken:
                    continue
                blob = np.asarray(s.buf, dtype=np.int32).tobytes()
                per_shard.setdefault(shard_of(s.group, self.num_shards), []).append(
                    (s.group, s.seq, s.start, blob, s.close))
                tokens += len(s.buf)
                nbytes += len(blob)
                s.start += len(s.buf)
                s.buf = []
                if s.close:
                    del self._seqs[key]
            self._dirty.clear()
            if not per_shard:
                return
            shards = list(per_shard)
            t0 = time.perf_counter()
            results = await self._call("append", [self._shards[i].append.remote(per_shard[i]) for i in shards])
            if results is None:
                if self._degraded:
                    self._m["dropped_tokens"] += tokens
                return  # slow: Ray still delivers these appends, before any later one
            self._append_lat.add(time.perf_counter() - t0)
            self._m["append_calls"] += len(shards)
            self._m["updates"] += sum(len(per_shard[i]) for i in shards)
            self._m["tokens"] += tokens
            self._m["append_bytes"] += nbytes
            for r in results:
                if r["gaps"] or r["errors"]:
                    self._m["gaps"] += len(r["gaps"])
                    self._m["server_errors"] += len(r["errors"])
                    logger.debug("DGDS append: gaps %s errors %s", r["gaps"][:3], r["errors"][:3])

    async def sync(self) -> None:
        """One sync tick now: flush the appends, then fetch and push each instance's deltas."""
        if self._degraded or not self._started:
            return
        async with self._sync_lock:
            await self._sync()

    async def _sync(self) -> None:
        await self.flush()
        if self._degraded:
            return
        self._m["syncs"] += 1
        # one fetch per distinct (shard, {group: version}) request: instances holding the same
        # versions of the same groups share it
        wanted: dict[tuple, list[_Served]] = {}
        for s in self._served.values():
            if s.paused_until > time.monotonic() or getattr(s.instance, "import_drafts", None) is None:
                continue
            per: dict[int, list] = {}
            for g in s.groups:
                per.setdefault(shard_of(g, self.num_shards), []).append((g, s.versions.get(g, 0)))
            for i, items in per.items():
                wanted.setdefault((i, tuple(sorted(items))), []).append(s)
        if not wanted:
            self._sync_bytes.append(0)
            return
        keys = list(wanted)
        t0 = time.perf_counter()
        answers = await self._call("fetch", [self._shards[i].fetch.remote(dict(items)) for i, items in keys])
        if answers is None:
            return
        self._fetch_lat.add(time.perf_counter() - t0)
        self._m["fetch_calls"] += len(keys)
        tick_bytes = 0
        pushes: dict[int, tuple[_Served, list, list]] = {}
        for key, ans in zip(keys, answers):
            tick_bytes += sum(len(b) for b, _ in ans.values())
            for s in wanted[key]:
                _, blobs, meta = pushes.setdefault(id(s.instance), (s, [], []))
                for g, (blob, version) in ans.items():
                    blobs.append(blob)
                    meta.append((g, version))
        self._m["bytes_synced"] += tick_bytes
        self._sync_bytes.append(tick_bytes)
        todo = [(s, blobs, meta) for s, blobs, meta in pushes.values() if blobs]
        if todo:
            await asyncio.gather(*(self._push(s, blobs, meta) for s, blobs, meta in todo))

    async def _push(self, s: _Served, blobs: list, meta: list) -> None:
        t0 = time.perf_counter()
        try:
            res = await asyncio.wait_for(s.instance.import_drafts(blobs), self.timeout_s)
            if len(res) != len(blobs):
                raise RuntimeError(f"import_drafts answered {len(res)} results for {len(blobs)} blobs")
        except Exception as exc:  # the engine's problem, not DGDS's: retry the same deltas later
            self._m["import_errors"] += 1
            s.fails += 1
            if s.fails >= PAUSE_AFTER_FAILS:
                # a busy or stalled engine (a long step, a weight sync): pause pushing there,
                # longer each time in a row, and try again; its requests draft from what it holds
                s.pause_s = min(max(2 * s.pause_s, PAUSE_S[0]), PAUSE_S[1])
                s.paused_until = time.monotonic() + s.pause_s
                s.fails = 0
                self._m["import_pauses"] += 1
                logger.warning("DGDS: %d imports in a row failed on instance %s (last: %r); pausing its pushes for %.0f s",
                               PAUSE_AFTER_FAILS, getattr(s.instance, "name", "?"), exc, s.pause_s)
            return
        self._import_lat.add(time.perf_counter() - t0)
        s.fails = 0
        s.pause_s = 0.0
        self._m["imports"] += 1
        self._m["blobs"] += len(blobs)
        for (g, version), r in zip(meta, res):
            if g not in s.groups:
                continue  # unserved meanwhile
            if r is not None and r >= 0:
                s.versions[g] = version
            else:  # refused (e.g. the engine evicted its copy): fetch the whole tree next time
                s.versions[g] = 0
                self._m["import_failures"] += 1

    async def _loop(self) -> None:
        next_tick = time.monotonic() + self.sync_interval_s
        try:
            while not self._stopping and not self._degraded:
                wait = next_tick - time.monotonic()
                if wait > 0:
                    try:
                        await asyncio.wait_for(self._wake.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                self._wake.clear()
                if self._stopping:
                    break
                if time.monotonic() >= next_tick:
                    await self.sync()
                    next_tick = time.monotonic() + self.sync_interval_s
                elif self._urgent:
                    await self.flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not reach the rollout
            self._degrade("sync loop", exc)

    async def _call(self, what: str, refs: list, timeout: Optional[float] = None):
        """Await Ray calls, all bounded by ``timeout``. A failure degrades the client; an answer
        later than the bound degrades it once answers have been late for ``stall_s``, at least
        ``SLOW_CALLS_BEFORE_DEGRADE`` calls in a row (at once while starting). Returns None unless
        every call answered in time."""
        sent = time.monotonic()
        try:
            out = await asyncio.wait_for(asyncio.gather(*refs), timeout or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError as exc:
            self._m["slow_calls"] += 1
            if self._slow_in_row == 0:
                self._slow_since = sent
            self._slow_in_row += 1
            stalled = (self._slow_in_row >= SLOW_CALLS_BEFORE_DEGRADE
                       and time.monotonic() - self._slow_since >= self.stall_s)
            if what == "start" or stalled:
                self._degrade(what, exc)
            else:
                logger.debug("DGDS %s answered later than %.1f s (%d in a row)", what, self.timeout_s,
                             self._slow_in_row)
            return None
        except Exception as exc:  # RayActorError, ...
            self._degrade(what, exc)
            return None
        self._slow_in_row = 0
        return out

    def _degrade(self, what: str, exc: BaseException) -> None:
        self._m["failures"] += 1
        if self._degraded:
            return
        self._degraded = True
        dropped = sum(len(s.buf) for s in self._seqs.values())
        self._m["dropped_tokens"] += dropped
        self._seqs.clear()
        self._dirty.clear()
        logger.warning(
            "DGDS %s failed (%s: %s); grouped drafts stop syncing for the rest of this client's life "
            "(engines keep request-scope drafting and the group trees they already hold)",
            what, type(exc).__name__,
            str(exc) or "no answer within %.1f s, %d calls in a row over %.0f s" % (
                self.timeout_s, self._slow_in_row, time.monotonic() - self._slow_since),
        )

    # -- metrics -------------------------------------------------------------------------------
    def metrics(self) -> dict:
        sb = np.asarray(self._sync_bytes, dtype=np.float64)
        return {
            "degraded": int(self._degraded),
            "shards": self.num_shards,
            **self._m,
            **self._append_lat.summary("append"),
            **self._fetch_lat.summary("fetch"),
            **self._import_lat.summary("import"),
            "bytes_per_sync": float(sb.mean()) if sb.size else 0.0,
            "bytes_per_sync_max": float(sb.max()) if sb.size else 0.0,
            "pending_tokens": sum(len(s.buf) for s in self._seqs.values()),
            "sequences": len(self._seqs),
            "instances": len(self._served),
        }
