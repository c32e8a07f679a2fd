"""What a simulated engine emits: the trace's response for each request.

A request is matched to its trace row by (group id, sample index), the identity every
strategy keeps when it re-submits a request in chunks. A continuation (a request whose prompt
is the original prompt plus already generated tokens, as in Seer's divided rollout) emits the
rest of the same response. Emitted tokens are ``TokenView``s over the trace's arrays, so a
134M-token simulation does not build Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verl_ext.engine.instance import FINISH_LENGTH, GenRequest


class TokenView(Sequence):
    """A read-only token sequence over a numpy array; ``list + view`` and ``view + list`` give
    lists, as they would with the list a real engine returns."""

    __slots__ = ("_a",)

    def __init__(self, array: np.ndarray):
        self._a = array

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return TokenView(self._a[i])
        return int(self._a[i])

    def __iter__(self):
        return iter(self._a.tolist())

    def __add__(self, other):
        return self._a.tolist() + list(other)

    def __radd__(self, other):
        return list(other) + self._a.tolist()

    def __eq__(self, other):
        return list(self) == list(other)

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)

    def __repr__(self) -> str:
        return f"TokenView({self._a.tolist()!r})"


@dataclass
class Target:
    """One request's future on a simulated engine."""

    row: int  # trace row
    prompt_len: int  # tokens in the request's prompt (original prompt + continuation)
    tokens: np.ndarray  # what the engine will emit, at most max_tokens
    finish_reason: str  # when all of ``tokens`` are emitted


class TraceSource:
    """Maps requests to rows of one epoch of a trace."""

    def __init__(self, trace, rows: np.ndarray | None = None):
        self.trace = trace
        rows = np.arange(len(trace)) if rows is None else np.asarray(rows)
        self.rows = rows
        self._by_key: dict[tuple[str, int], int] = {}
        self._groups: dict[str, list[int]] = {}
        for i in rows.tolist():
            key = (str(trace.prompt_uid[i]), int(trace.sample_index[i]))
            if key in self._by_key:
                raise ValueError(f"trace has two rows for prompt {key[0]!r} sample {key[1]}")
            self._by_key[key] = i
            self._groups.setdefault(key[0], []).append(i)
        self._plen = trace.prompt_lengths()

    def row_of(self, group_id: str, sample_index: int) -> int:
        try:
            return self._by_key[(group_id, sample_index)]
        except KeyError:
            raise ValueError(
                f"the simulated engine got a request (group {group_id!r}, sample {sample_index}) "
                "that is not in its trace"
            ) from None

    def target(self, request: GenRequest) -> Target:
        i = self.row_of(request.group_id, request.sample_index)
        response = self.trace.response(i)
        offset = len(request.prompt_ids) - int(self._plen[i])
        if offset < 0 or offset > len(response):
            raise ValueError(
                f"request {request.request_id}: its prompt ({len(request.prompt_ids)} tokens) is not "
                f"the trace prompt ({self._plen[i]}) plus part of the trace response ({len(response)})"
            )
        rest = response[offset:]
        limit = request.sampling.max_tokens
        if len(rest) > limit:
            return Target(i, len(request.prompt_ids), rest[:limit], FINISH_LENGTH)
        return Target(i, len(request.prompt_ids), rest, str(self.trace.finish_reason[i]))

    def prompt_len(self, i: int) -> int:
        return int(self._plen[i])

    def full_row(self, i: int) -> np.ndarray:
        """Prompt + response of trace row ``i``."""
        return np.concatenate([self.trace.prompt(i), self.trace.response(i)]).astype(np.int32, copy=False)

    def groups(self) -> list[str]:
        return list(self._groups)

    def group_rows(self, group_id: str) -> list[int]:
        return self._groups.get(group_id, [])
