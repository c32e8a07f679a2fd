"""Per-prompt rollout history: the data a history worker keeps between epochs (RhymeRL
sections 4.2 and 5.3; the length statistics are HistoPipe's, section 6).

For every prompt uid, ``HistoryStore`` keeps its last ``keep`` rollouts (a rollout: all responses
the prompt got in one training step), each response as compact int32 token ids with its reward.
A rollout is open while its step's trajectories stream in; the next step's first trajectory of the
same prompt closes it. What a step may draft from (``serve(uid, step)``) is only earlier steps'
responses: never the step's own, which are the group scope's business.

Statistics (section 6.2 and 6.3):

* ``median_length(uid)``: the median response length of the prompt's latest closed-or-earlier
  rollout, HistoPipe's *historical response length* for ranking.
* ``max_length(uid)``: the longest response of that rollout (the migration threshold's base).
* growth rates: when a prompt's rollout follows an earlier one, ``max(new) / max(previous)``;
  ``growth_percentile(75)`` over the latest epoch's rates is the migration factor beta (the
  caller floors it at 1.1, section 6.3).

Memory: ``max_bytes`` caps the token bytes held; past it, the least recently ingested prompts'
oldest rollouts are evicted first (an evicted prompt simply has no history). ``dumps``/``loads``
give a versioned, checksummed snapshot for checkpoints; a corrupt snapshot raises
``HistoryCorrupt`` (the worker then starts fresh, never crashing training).
"""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

#: a snapshot's magic and format version
MAGIC = b"VXHIST"
VERSION = 1


#: bytes per response token held (int32 ids)
BYTES_PER_TOKEN = np.dtype(np.int32).itemsize

class HistoryCorrupt(ValueError):
    """A history snapshot that cannot be read (truncated, wrong checksum, unknown version)."""


def history_weight(reward: Optional[float]) -> float:
    """A response's weight in its prompt's history tree (reward-aware branch priority, section
    5.3): its reward clipped at 0, plus 0.1 so that zero-reward responses still count, less.
    NaN / None (unscored) count as 0 reward."""
    if reward is None or not np.isfinite(reward):
        return 0.1
    return max(float(reward), 0.0) + 0.1


@dataclass(frozen=True)
class Trajectory:
    """One finished response, as the rollout manager hands it to the history workers."""

    uid: str  # the prompt's uid (veRL's ``uid`` / the trace's prompt uid)
    step: int  # the training step that generated it
    sample: int  # its index within the prompt's group
    response_ids: Sequence[int]
    reward: Optional[float] = None


@dataclass
class Rollout:
    step: int
    responses: list = field(default_factory=list)  # int32 arrays
    rewards: list = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.responses)


class PromptHistory:
    """The rollouts of one prompt, oldest first."""

    def __init__(self, keep: int):
        self.rollouts: deque[Rollout] = deque()
        self.keep = keep

    def rollout_for(self, step: int) -> Optional[Rollout]:
        for r in self.rollouts:
            if r.step == step:
                return r
        return None

    def before(self, step: Optional[int]) -> list[Rollout]:
        """The rollouts of steps before ``step`` (all of them for None), newest last, at most ``keep``."""
        rs = [r for r in self.rollouts if step is None or r.step < step]
        return rs[-self.keep:]


class HistoryStore:
    """Ingests trajectories, keeps each prompt's last ``keep`` rollouts plus the one being
    filled, and answers draft and length queries. Not thread-safe (one actor)."""

    def __init__(self, keep: int = 1, max_bytes: int = 1 << 30):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (rollouts per prompt), got {keep}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.keep = keep
        self.max_bytes = max_bytes
        self.prompts: OrderedDict[str, PromptHistory] = OrderedDict()  # least recently ingested first
        self.bytes = 0
        self.latest_step: Optional[int] = None
        self._growth: dict[int, list[float]] = {}  # step -> growth rates of prompts rolled out then
        # capped_prompts: prompts whose whole history the byte cap dropped
        self.counters = {"ingested": 0, "ingested_tokens": 0, "stale": 0, "evicted_rollouts": 0,
                         "evicted_tokens": 0, "capped_prompts": 0}

    # -- ingest ---------------------------------------------------------------------------------
    def ingest(self, trajectories: Iterable[Trajectory]) -> int:
        n = 0
        for t in trajectories:
            self._ingest_one(t)
            n += 1
        self._enforce_cap()
        return n

    def _ingest_one(self, t: Trajectory) -> None:
        uid = str(t.uid)
        step = int(t.step)
        p = self.prompts.get(uid)
        if p is None:
            p = self.prompts[uid] = PromptHistory(self.keep)
        else:
            self.prompts.move_to_end(uid)
        r = p.rollout_for(step)
        if r is None:
            if len(p.rollouts) > self.keep and step < p.rollouts[0].step:
                self.counters["stale"] += 1  # older than everything we keep: drop it
                return
            r = Rollout(step)
            p.rollouts.append(r)
            p.rollouts = deque(sorted(p.rollouts, key=lambda x: x.step))
            self._trim(p)
        toks = np.asarray(t.response_ids, dtype=np.int32).copy()
        r.responses.append(toks)
        r.rewards.append(None if t.reward is None else float(t.reward))
        self.bytes += toks.nbytes
        self.counters["ingested"] += 1
        self.counters["ingested_tokens"] += int(toks.size)
        self.latest_step = step if self.latest_step is None else max(self.latest_step, step)

    def _trim(self, p: PromptHistory) -> None:
        """Keep ``keep`` closed rollouts plus the newest (open) one."""
        while len(p.rollouts) > self.keep + 1:
            old = p.rollouts.popleft()
            self._evicted(old)

    def _evicted(self, r: Rollout) -> None:
        self.bytes -= r.nbytes
        self.counters["evicted_rollouts"] += 1
        self.counters["evicted_tokens"] += sum(x.size for x in r.responses)

    def _enforce_cap(self) -> None:
        while self.bytes > self.max_bytes and self.prompts:
            uid, p = next(iter(self.prompts.items()))
            if p.rollouts:
                self._evicted(p.rollouts.popleft())
            if not p.rollouts:
                del self.prompts[uid]
                self.counters["capped_prompts"] += 1

    def close_step(self, step: int) -> list[float]:
        """Step ``step`` is over: record the growth rates of the prompts it rolled out (their longest
        response over their previous rollout's longest). Returns them."""
        rates = []
        for p in self.prompts.values():
            cur = p.rollout_for(step)
            prev = p.before(step)
            if cur is None or not prev or not cur.responses or not prev[-1].responses:
                continue
            pm = max(prev[-1].lengths)
            if pm > 0:
                rates.append(max(cur.lengths) / pm)
        self._growth[step] = rates
        for s in sorted(self._growth)[:-self.keep - 1]:
            del self._growth[s]
        return rates

    # -- queries ---------------------------------------------------------------------------------
    def serve(self, uid: str, step: Optional[int] = None) -> tuple[list[np.ndarray], list[float]]:
        """The responses step ``step`` may draft from (earlier steps' rollouts of ``uid``) and their
        tree weights; ([], []) for an unknown prompt."""
        p = self.prompts.get(str(uid))
        if p is None:
            return [], []
        toks, ws = [], []
        for r in p.before(step):
            toks.extend(r.responses)
            ws.extend(history_weight(x) for x in r.rewards)
        return toks, ws

    def _last(self, uid: str, step: Optional[int]) -> Optional[Rollout]:
        p = self.prompts.get(str(uid))
        if p is None:
            return None
        rs = [r for r in p.before(step) if r.responses]
        return rs[-1] if rs else None

    def median_length(self, uid: str, step: Optional[int] = None) -> Optional[float]:
        r = self._last(uid, step)
        return None if r is None else float(np.median(r.lengths))

    def max_length(self, uid: str, step: Optional[int] = None) -> Optional[int]:
        r = self._last(uid, step)
        return None if r is None else int(max(r.lengths))

    def lengths(self, uids: Iterable[str], step: Optional[int] = None) -> dict[str, tuple]:
        """{uid: (median, max, median of the even samples, median of the odd samples)} of the
        prompts that have history before ``step``; the two half medians (equal for one sample)
        let HistoPipe measure how reproducible a rank is (split-half reliability)."""
        out = {}
        for u in uids:
            r = self._last(u, step)
            if r is not None:
                ls = r.lengths
                odd = ls[1::2] or ls
                out[str(u)] = (float(np.median(ls)), int(max(ls)), float(np.median(ls[0::2])), float(np.median(odd)))
        return out

    def growth_rates(self, step: Optional[int] = None) -> list[float]:
        """The growth rates of the latest closed step before ``step`` (any closed step for None)."""
        steps = [s for s in self._growth if (step is None or s < step) and self._growth[s]]
        return list(self._growth[max(steps)]) if steps else []

    def growth_percentile(self, q: float = 75.0, step: Optional[int] = None) -> Optional[float]:
        """The ``q``-th percentile of ``growth_rates(step)``; None when there are none."""
        rates = self.growth_rates(step)
        return float(np.percentile(rates, q)) if rates else None

    def stats(self) -> dict:
        return {
            "prompts": len(self.prompts),
            "rollouts": sum(len(p.rollouts) for p in self.prompts.values()),
            "tokens_held": self.bytes // BYTES_PER_TOKEN,
            "bytes_held": self.bytes,
            **self.counters,
        }

    # -- snapshots ---------------------------------------------------------------------------------
    def dumps(self) -> bytes:
        """A snapshot: magic, version, sha256 of the payload, zlib-compressed payload."""
        buf = io.BytesIO()
        w = buf.write
        w(struct.pack("<qqi", self.keep, self.max_bytes, -1 if self.latest_step is None else self.latest_step))
        w(struct.pack("<i", len(self._growth)))
        for s, rates in self._growth.items():
            w(struct.pack("<qi", s, len(rates)))
            w(np.asarray(rates, dtype=np.float64).tobytes())
        w(struct.pack("<i", len(self.prompts)))
        for uid, p in self.prompts.items():
            ub = uid.encode()
            w(struct.pack("<i", len(ub)))
            w(ub)
            w(struct.pack("<i", len(p.rollouts)))
            for r in p.rollouts:
                w(struct.pack("<qi", r.step, len(r.responses)))
                rw = np.asarray([np.nan if x is None else x for x in r.rewards], dtype=np.float64)
                w(rw.tobytes())
                w(np.asarray(r.lengths, dtype=np.int64).tobytes())
                for x in r.responses:
                    w(x.tobytes())
        payload = zlib.compress(buf.getvalue(), 1)
        return MAGIC + struct.pack("<i", VERSION) + hashlib.sha256(payload).digest() + payload

    @classmethod
    def loads(cls, blob: bytes, max_bytes: Optional[int] = None) -> "HistoryStore":
        head = len(MAGIC) + 4 + 32
        if len(blob) < head or blob[:len(MAGIC)] != MAGIC:
            raise HistoryCorrupt("not a verl_ext history snapshot (bad magic or truncated)")
        (version,) = struct.unpack_from("<i", blob, len(MAGIC))
        if version != VERSION:
            raise HistoryCorrupt(f"history snapshot version {version}; this verl_ext reads version {VERSION}")
        digest, payload = blob[len(MAGIC) + 4:head], blob[head:]
        if hashlib.sha256(payload).digest() != digest:
            raise HistoryCorrupt("history snapshot checksum mismatch (truncated or corrupted file)")
        try:
            return cls._parse(zlib.decompress(payload), max_bytes)
        except (zlib.error, struct.error, ValueError, UnicodeDecodeError) as exc:
            raise HistoryCorrupt(f"history snapshot unreadable: {exc}") from exc

    @classmethod
    def _parse(cls, data: bytes, max_bytes: Optional[int]) -> "HistoryStore":
        mv = memoryview(data)
        pos = 0

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from(fmt, mv, pos)
            pos += struct.calcsize(fmt)
            return v

        def arr(dtype, n):
            nonlocal pos
            nb = np.dtype(dtype).itemsize * n
            if pos + nb > len(mv):
                raise ValueError("truncated array")
            a = np.frombuffer(mv[pos:pos + nb], dtype=dtype).copy()
            pos += nb
            return a

        keep, mb, latest = take("<qqi")
        st = cls(keep=int(keep), max_bytes=int(mb if max_bytes is None else max_bytes))
        st.latest_step = None if latest < 0 else int(latest)
        (ng,) = take("<i")
        for _ in range(ng):
            s, n = take("<qi")
            st._growth[int(s)] = arr(np.float64, n).tolist()
        (np_,) = take("<i")
        for _ in range(np_):
            (ul,) = take("<i")
            uid = bytes(mv[pos:pos + ul]).decode()
            pos += ul
            p = st.prompts[uid] = PromptHistory(st.keep)
            (nr,) = take("<i")
            for _ in range(nr):
                s, n = take("<qi")
                r = Rollout(int(s))
                rewards = arr(np.float64, n)
                lens = arr(np.int64, n)
                r.rewards = [None if np.isnan(x) else float(x) for x in rewards]
                for L in lens:
                    r.responses.append(arr(np.int32, int(L)))
                p.rollouts.append(r)
                st.bytes += r.nbytes
        if pos != len(mv):
            raise ValueError(f"{len(mv) - pos} trailing bytes")
        st._enforce_cap()
        return st


__all__ = ["HistoryStore", "HistoryCorrupt", "Trajectory", "history_weight", "MAGIC", "VERSION"]


class LocalHistory:
    """The history provider interface over a ``HistoryStore`` in this process (the same async
    methods as ``HistoryClient``)."""

    def __init__(self, store):
        self.store = store

    async def lengths(self, uids, step=None) -> dict:
        return self.store.lengths(uids, step)

    async def growth_percentile(self, q: float = 75.0, step=None):
        return self.store.growth_percentile(q, step)

    async def serve(self, uids, step=None) -> dict:
        return {u: v for u in uids if (v := self.store.serve(u, step))[0]}
