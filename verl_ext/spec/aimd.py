"""RhymeRL's AIMD draft window (RhymeRL section 5.4, "AIMD-like Token Speculation").

Each response has its own draft window: it starts at ``start`` tokens (2), grows by ``step`` (2)
after every step whose whole draft was accepted, up to ``max_window`` (32, the drafter's ``k``),
and falls back to ``start`` as soon as a drafted token is rejected. Long runs of history that
the response follows get long drafts; after a divergence drafting is cheap again at once.

This is the rule for live engines (the vLLM proposer) and the simulator's step-by-step replay;
the native lockstep/cached replay (``DraftIndex.replay(aimd_start=, aimd_step=)``) applies the
same rule in C++ (tests/test_rhyme.py checks that the two agree).
"""

from __future__ import annotations

import numpy as np


class AimdWindows:
    def __init__(self, start: int = 2, step: int = 2, max_window: int = 32):
        if not 1 <= start <= max_window:
            raise ValueError(f"AIMD needs 1 <= start <= max_window, got start={start}, max_window={max_window}")
        if step < 0:
            raise ValueError(f"AIMD step must be >= 0, got {step}")
        self.start = int(start)
        self.step = int(step)
        self.max_window = int(max_window)
        self._w: dict = {}
        self.grown = 0
        self.reset = 0

    def get(self, key) -> int:
        return self._w.get(key, self.start)

    def get_many(self, keys) -> np.ndarray:
        get, s = self._w.get, self.start
        return np.fromiter((get(k, s) for k in keys), dtype=np.int64, count=len(keys))

    def observe(self, key, drafted: int, accepted: int) -> int:
        """The step drafted ``drafted`` tokens for ``key`` and ``accepted`` of them were accepted;
        returns the new window. A step without drafts leaves the window as it is."""
        if drafted <= 0:
            return self.get(key)
        if accepted >= drafted:
            w = min(self.get(key) + self.step, self.max_window)
            self.grown += 1
        else:
            w = self.start
            self.reset += 1
        self._w[key] = w
        return w

    def drop(self, key) -> None:
        self._w.pop(key, None)

    def __len__(self) -> int:
        return len(self._w)
