"""The rollout trace format: one row per response, stored as Parquet.

A trace records what a rollout produced (which prompt, which sample, the token ids, the
reward, why it stopped) and, when known, when it happened (submit/finish times, per-token
arrival times, the serving instance). ``verl-ext trace record`` writes traces from local
real engines, the veRL manager hook writes one per training step, and the simulator and
benchmarks replay them.

Format ``verl_ext.trace``, version 1
------------------------------------

One Parquet file (zstd-compressed), one row per response. Columns:

=================  ========================  =================================================
column             Arrow type                meaning
=================  ========================  =================================================
``epoch``          int32                     rollout round. ``trace record``: the epoch (the
                                             same prompts are rolled out again each epoch, like
                                             RL epochs); veRL traces: the training step.
``step``           int32                     training step (``== epoch`` for ``trace record``;
                                             veRL's ``global_steps`` in veRL traces)
``prompt_uid``     string                    the prompt / GRPO group id (veRL's ``uid``)
``sample_index``   int32                     which of the group's samples (0..n-1)
``prompt_ids``     large_list<int32>         prompt token ids (chat template applied)
``response_ids``   large_list<int32>         response token ids
``reward``         float32                   reward; NaN when unknown
``finish_reason``  string                    ``stop`` | ``length`` | ``abort``
``instance``       string (nullable)         engine instance that served it; null if unknown
``submit_s``       float64                   seconds from the round's first submit; NaN if unknown
``finish_s``       float64                   seconds from the round's first submit; NaN if unknown
``token_times``    large_list<float32>       *optional column*. Per row either empty (unknown)
                                             or exactly one entry per response token: seconds
                                             from the request's submit until the client
                                             received that token. Tokens delivered in one
                                             chunk (one engine step, or a verified draft)
                                             share a timestamp, so chunks can be recovered.
=================  ========================  =================================================

Token ids are in ``[0, 2**31)``. Times are wall-clock seconds (``time.monotonic`` deltas for
``trace record``; ``time.time`` deltas across processes for veRL traces).

Schema metadata (Parquet key/value metadata): ``verl_ext.trace.format = "verl_ext.trace"``,
``verl_ext.trace.version = "1"`` and ``verl_ext.trace.meta`` = a JSON object: ``source``
(``"real"`` | ``"synthetic"`` | ``"verl"``), ``model``, ``tokenizer``, ``created``,
``workload``, ``seeds`` and whatever else the producer knows.

Version policy: the version is bumped on any change that an older reader would misread
(removed or retyped columns, changed units or semantics). Adding an *optional* column does
not bump it. Readers accept exactly the versions they support and refuse any other one with
a ``TraceFormatError`` that names the file, the version found and the version supported.

In memory (``Trace``) the per-row columns are numpy arrays and the three token-list columns
are the file's Arrow ``large_list`` arrays (``prompt_lists``, ``response_lists``,
``token_time_lists``): reading and writing pass them through, and ``select``/``concat`` are
Arrow's ``filter``/``take``/``concat_arrays``. Their flat values and ``int64`` offsets are
read-only, zero-copy numpy views (row ``i`` is ``values[offsets[i]:offsets[i+1]]``), taken
once per trace, so ``prompt(i)``/``response(i)``/``times(i)`` are two slices.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

TRACE_FORMAT = "verl_ext.trace"
TRACE_VERSION = 1

FINISH_REASONS = ("stop", "length", "abort")
MAX_TOKEN_ID = 2**31  # exclusive

_KEY_FORMAT = b"verl_ext.trace.format"
_KEY_VERSION = b"verl_ext.trace.version"
_KEY_META = b"verl_ext.trace.meta"

#: required columns (``token_times`` is optional)
COLUMNS = (
    "epoch",
    "step",
    "prompt_uid",
    "sample_index",
    "prompt_ids",
    "response_ids",
    "reward",
    "finish_reason",
    "instance",
    "submit_s",
    "finish_s",
)
OPTIONAL_COLUMNS = ("token_times",)
#: the per-row (non-list) columns, in file order
_ROW_COLUMNS = ("epoch", "step", "prompt_uid", "sample_index", "reward", "finish_reason", "instance", "submit_s", "finish_s")


class TraceFormatError(ValueError):
    """A trace file or in-memory trace is malformed; the message names the file and the problem."""


class Trace:
    """One row per response. Per-row columns are numpy arrays (``epoch``, ``step``, ``prompt_uid``,
    ``sample_index``, ``reward``, ``finish_reason``, ``instance``, ``submit_s``, ``finish_s``; they
    may be edited in place, ``validate`` checks them). The token lists are immutable Arrow
    ``large_list`` arrays (``prompt_lists``, ``response_lists``, ``token_time_lists`` or None)
    with read-only zero-copy numpy views: ``prompt_tokens``/``prompt_offsets``,
    ``response_tokens``/``response_offsets``, ``token_times``/``token_time_offsets``.

    The constructor takes the lists as flat values plus ``int64`` offsets (row ``i`` is
    ``values[offsets[i]:offsets[i+1]]``), wraps them without copying, and refuses malformed
    offsets with a ``TraceFormatError`` (a trace cannot hold them)."""

    def __init__(
        self,
        epoch,
        step,
        prompt_uid,
        sample_index,
        prompt_tokens,
        prompt_offsets,
        response_tokens,
        response_offsets,
        reward,
        finish_reason,
        instance,
        submit_s,
        finish_s,
        token_times=None,
        token_time_offsets=None,
        meta: Optional[dict] = None,
    ) -> None:
        if (token_times is None) != (token_time_offsets is None):
            raise TraceFormatError("in-memory trace: token_times and token_time_offsets must both be set or both None")
        n = np.shape(epoch)[0] if np.ndim(epoch) else 0
        prompts = _list_array(_int32_tokens(prompt_tokens), prompt_offsets, n, "prompt_ids")
        responses = _list_array(_int32_tokens(response_tokens), response_offsets, n, "response_ids")
        times = None
        if token_times is not None:
            times = _list_array(np.asarray(token_times, dtype=np.float32).reshape(-1), token_time_offsets, n, "token_times")
        self._set(epoch, step, prompt_uid, sample_index, reward, finish_reason, instance, submit_s, finish_s,
                  prompts, responses, times, meta)

    @classmethod
    def _from_lists(cls, *, prompt_lists, response_lists, token_time_lists=None, meta=None, **rows) -> "Trace":
        """A trace over Arrow list arrays of the in-memory types (``large_list<int32>`` token ids,
        ``large_list<float32>`` times), which it keeps (no copy unless sliced)."""
        self = cls.__new__(cls)
        self._set(meta=meta, prompts=_normalized(prompt_lists), responses=_normalized(response_lists),
                  times=None if token_time_lists is None else _normalized(token_time_lists), **rows)
        return self

    def _set(self, epoch, step, prompt_uid, sample_index, reward, finish_reason, instance, submit_s, finish_s,
             prompts, responses, times, meta) -> None:
        self.epoch = np.asarray(epoch, dtype=np.int32)
        self.step = np.asarray(step, dtype=np.int32)
        self.prompt_uid = _object_array(prompt_uid)
        self.sample_index = np.asarray(sample_index, dtype=np.int32)
        self.reward = np.asarray(reward, dtype=np.float32)
        self.finish_reason = _object_array(finish_reason)
        self.instance = _object_array(instance)
        self.submit_s = np.asarray(submit_s, dtype=np.float64)
        self.finish_s = np.asarray(finish_s, dtype=np.float64)
        self.meta = {} if meta is None else meta
        self._prompts, self._responses, self._times = prompts, responses, times
        self._views()

    def _views(self) -> None:
        # taken once: the hot paths (prompt/response/times per row) are two numpy slices
        self._po, self._pv = _numpy_views(self._prompts)
        self._ro, self._rv = _numpy_views(self._responses)
        self._to, self._tv = (None, None) if self._times is None else _numpy_views(self._times)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_po", "_pv", "_ro", "_rv", "_to", "_tv")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    def __repr__(self) -> str:
        return (f"Trace({len(self)} rows, epochs {self.epochs()}, {self._rv.size} response tokens, "
                f"token_times {'yes' if self._times is not None else 'no'}, meta keys {sorted(self.meta)})")

    # -- the token lists -------------------------------------------------------------------------
    @property
    def prompt_lists(self):
        """``prompt_ids`` as a ``pyarrow.LargeListArray`` of int32."""
        return self._prompts

    @property
    def response_lists(self):
        """``response_ids`` as a ``pyarrow.LargeListArray`` of int32."""
        return self._responses

    @property
    def token_time_lists(self):
        """``token_times`` as a ``pyarrow.LargeListArray`` of float32, or None without the column."""
        return self._times

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self._pv

    @property
    def prompt_offsets(self) -> np.ndarray:
        return self._po

    @property
    def response_tokens(self) -> np.ndarray:
        return self._rv

    @property
    def response_offsets(self) -> np.ndarray:
        return self._ro

    @property
    def token_times(self) -> Optional[np.ndarray]:
        return self._tv

    @property
    def token_time_offsets(self) -> Optional[np.ndarray]:
        return self._to

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.epoch.shape[0])

    def prompt(self, i: int) -> np.ndarray:
        return self._pv[self._po[i] : self._po[i + 1]]

    def response(self, i: int) -> np.ndarray:
        return self._rv[self._ro[i] : self._ro[i + 1]]

    def times(self, i: int) -> Optional[np.ndarray]:
        """Per-token arrival times of row ``i`` (empty if unknown), or None without the column."""
        if self._tv is None:
            return None
        return self._tv[self._to[i] : self._to[i + 1]]

    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self._po)

    def response_lengths(self) -> np.ndarray:
        return np.diff(self._ro)

    def epochs(self) -> list[int]:
        return sorted(int(e) for e in np.unique(self.epoch))

    # -- transforms ----------------------------------------------------------------------------
    def select(self, mask_or_indices) -> "Trace":
        """A new trace with the given rows (a boolean mask of length ``n`` or row indices)."""
        import pyarrow as pa

        sel = np.asarray(mask_or_indices)
        if sel.dtype == bool:
            if sel.shape != (len(self),):
                raise IndexError(f"boolean mask has shape {sel.shape}, trace has {len(self)} rows")
            rows = sel
            keep = pa.array(sel)
            pick = lambda lists: lists.filter(keep)  # noqa: E731
        else:
            rows = sel.astype(np.int64, copy=False).reshape(-1)
            if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
                raise IndexError(f"row index out of range for a trace of {len(self)} rows")
            rows = np.where(rows < 0, rows + len(self), rows)
            take = pa.array(rows)
            pick = lambda lists: lists.take(take)  # noqa: E731
        return Trace._from_lists(
            **{name: getattr(self, name)[rows] for name in _ROW_COLUMNS},
            prompt_lists=pick(self._prompts),
            response_lists=pick(self._responses),
            token_time_lists=None if self._times is None else pick(self._times),
            meta=dict(self.meta),
        )

    @classmethod
    def concat(cls, traces: Sequence["Trace"]) -> "Trace":
        """Rows of all ``traces`` in order; ``meta`` is the first trace's. If any trace has
        ``token_times``, rows of the others get empty (unknown) time lists."""
        import pyarrow as pa

        traces = list(traces)
        if not traces:
            return cls.from_rows([])
        times = None
        if any(t._times is not None for t in traces):
            times = pa.concat_arrays([t._times if t._times is not None else _empty_lists(len(t), pa.float32())
                                      for t in traces])
        return cls._from_lists(
            **{name: np.concatenate([getattr(t, name) for t in traces]) for name in _ROW_COLUMNS},
            prompt_lists=pa.concat_arrays([t._prompts for t in traces]),
            response_lists=pa.concat_arrays([t._responses for t in traces]),
            token_time_lists=times,
            meta=dict(traces[0].meta),
        )

    # -- rows --------------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Iterable[dict], meta: Optional[dict] = None) -> "Trace":
        """Build a trace from dicts with the column names: ``epoch``, ``step`` (default: epoch),
        ``prompt_uid``, ``sample_index`` (default 0), ``prompt_ids``, ``response_ids`` (lists),
        ``reward`` (default NaN), ``finish_reason``, ``instance`` (default None), ``submit_s`` /
        ``finish_s`` (default NaN), ``token_times`` (optional list, one time per response token).
        The trace has a ``token_times`` column iff some row has a non-None ``token_times``."""
        import pyarrow as pa

        rows = list(rows)
        n = len(rows)
        nan = float("nan")
        try:
            epoch = [int(r["epoch"]) for r in rows]
            step = [int(r.get("step", r["epoch"])) for r in rows]
            uid = [str(r["prompt_uid"]) for r in rows]
            sample = [int(r.get("sample_index", 0)) for r in rows]
            prompts = [r["prompt_ids"] for r in rows]
            responses = [r["response_ids"] for r in rows]
            finish = [r["finish_reason"] for r in rows]
        except KeyError as exc:
            raise TraceFormatError(f"in-memory trace: row is missing key {exc}") from None
        reward = [nan if r.get("reward") is None else float(r["reward"]) for r in rows]
        instance = [None if r.get("instance") is None else str(r["instance"]) for r in rows]
        submit = [nan if r.get("submit_s") is None else float(r["submit_s"]) for r in rows]
        finish_s = [nan if r.get("finish_s") is None else float(r["finish_s"]) for r in rows]

        def ids(lists, column):  # wide first, so that out-of-range ids are seen, not wrapped
            arr = pa.array(lists, type=pa.large_list(pa.int64()))
            _check_ids(_numpy_views(arr)[1], column, "in-memory trace")
            return arr.cast(pa.large_list(pa.int32()), safe=False)

        times = None
        if any(r.get("token_times") is not None for r in rows):
            times = pa.array([() if r.get("token_times") is None else r["token_times"] for r in rows],
                             type=pa.large_list(pa.float64())).cast(pa.large_list(pa.float32()), safe=False)
        return cls._from_lists(
            epoch=np.array(epoch, dtype=np.int32).reshape(n),
            step=np.array(step, dtype=np.int32).reshape(n),
            prompt_uid=uid,
            sample_index=np.array(sample, dtype=np.int32).reshape(n),
            reward=np.array(reward, dtype=np.float32).reshape(n),
            finish_reason=finish,
            instance=instance,
            submit_s=np.array(submit, dtype=np.float64).reshape(n),
            finish_s=np.array(finish_s, dtype=np.float64).reshape(n),
            prompt_lists=ids(prompts, "prompt_ids"),
            response_lists=ids(responses, "response_ids"),
            token_time_lists=times,
            meta=dict(meta or {}),
        )

    def to_rows(self) -> list[dict]:
        """The inverse of ``from_rows`` (``token_times`` is None for every row without the column)."""
        prompts, responses = self._prompts.to_pylist(), self._responses.to_pylist()
        times = [None] * len(self) if self._times is None else self._times.to_pylist()
        rows = []
        for i in range(len(self)):
            rows.append(
                {
                    "epoch": int(self.epoch[i]),
                    "step": int(self.step[i]),
                    "prompt_uid": self.prompt_uid[i],
                    "sample_index": int(self.sample_index[i]),
                    "prompt_ids": prompts[i],
                    "response_ids": responses[i],
                    "reward": float(self.reward[i]),
                    "finish_reason": self.finish_reason[i],
                    "instance": self.instance[i],
                    "submit_s": float(self.submit_s[i]),
                    "finish_s": float(self.finish_s[i]),
                    "token_times": times[i],
                }
            )
        return rows

    # -- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Shapes, offsets, token ids, finish reasons; raises ``TraceFormatError``."""
        self._check("in-memory trace")

    def _check(self, where: str, ids: bool = True) -> None:
        n = len(self)

        def fail(msg: str):
            raise TraceFormatError(f"{where}: {msg}")

        for name in ("epoch", "step", "prompt_uid", "sample_index", "reward", "finish_reason", "instance", "submit_s", "finish_s"):
            arr = getattr(self, name)
            if arr.shape != (n,):
                fail(f"column '{name}' has shape {arr.shape}, expected ({n},)")
        _check_offsets(self._po, self._pv, n, "prompt_ids", fail)
        _check_offsets(self._ro, self._rv, n, "response_ids", fail)
        if self._times is not None:
            _check_offsets(self._to, self._tv, n, "token_times", fail)
            counts = np.diff(self._to)
            bad = np.flatnonzero((counts != 0) & (counts != self.response_lengths()))
            if bad.size:
                i = int(bad[0])
                fail(
                    f"token_times of row {i} has {int(counts[i])} entries; expected 0 (unknown) or one per "
                    f"response token ({int(self.response_lengths()[i])})"
                )
        if ids:  # (read_trace checked them before narrowing to int32)
            _check_ids(self._pv, "prompt_ids", where)
            _check_ids(self._rv, "response_ids", where)
        if n and (self.sample_index.min() < 0):
            fail(f"negative sample_index in row {int(np.argmin(self.sample_index))}")
        ok = np.isin(self.finish_reason, np.array(FINISH_REASONS, dtype=object))
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            fail(f"row {i} has finish_reason {self.finish_reason[i]!r}; valid: {list(FINISH_REASONS)}")
        for name in ("prompt_uid",):
            arr = getattr(self, name)
            bad = [i for i, v in enumerate(arr) if not isinstance(v, str)] if n else []
            if bad:
                fail(f"column '{name}' row {bad[0]} is {arr[bad[0]]!r}, expected a string")
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as exc:
            fail(f"meta is not JSON-serialisable ({exc})")


# -- helpers -----------------------------------------------------------------------------------
def _object_array(values) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    seq = list(values)
    out = np.empty(len(seq), dtype=object)
    out[:] = seq
    return out


def _int32_tokens(values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype != np.int32:
        if not np.issubdtype(arr.dtype, np.integer):
            raise TraceFormatError(f"in-memory trace: token ids must be integers, got dtype {arr.dtype}")
        _check_ids(arr, "token ids", "in-memory trace")
        arr = arr.astype(np.int32)
    return arr.reshape(-1)


def _check_ids(values: np.ndarray, column: str, where: str) -> None:
    if values.size == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= MAX_TOKEN_ID:
        bad = lo if lo < 0 else hi
        raise TraceFormatError(f"{where}: {column} has token id {bad} outside [0, 2**31)")


def _check_offsets(offsets: np.ndarray, values: np.ndarray, n: int, column: str, fail) -> None:
    if offsets.shape != (n + 1,):
        fail(f"{column} offsets have shape {offsets.shape}, expected ({n + 1},)")
    if offsets[0] != 0:
        fail(f"{column} offsets start at {int(offsets[0])}, expected 0")
    if n and (np.diff(offsets) < 0).any():
        i = int(np.flatnonzero(np.diff(offsets) < 0)[0])
        fail(f"{column} offsets decrease at row {i} ({int(offsets[i])} -> {int(offsets[i + 1])})")
    if offsets[-1] != values.shape[0] or values.ndim != 1:
        fail(f"{column} offsets end at {int(offsets[-1])} but there are {values.shape[0]} values")


def _list_array(values: np.ndarray, offsets, n: int, column: str):
    """``large_list`` over flat ``values`` and ``offsets`` (checked; wrapped, not copied)."""
    import pyarrow as pa

    offsets = np.asarray(offsets, dtype=np.int64)

    def fail(msg: str):
        raise TraceFormatError(f"in-memory trace: {msg}")

    _check_offsets(offsets, values, n, column, fail)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.ascontiguousarray(values)))


def _empty_lists(n: int, value_type):
    """``n`` empty lists."""
    import pyarrow as pa

    return pa.LargeListArray.from_arrays(pa.array(np.zeros(n + 1, np.int64)), pa.array([], type=value_type))


def _normalized(lists):
    """``lists`` with offsets starting at 0 and exactly its rows' values (a slice is re-based)."""
    import pyarrow as pa

    offsets = lists.offsets.to_numpy()
    lo, hi = int(offsets[0]), int(offsets[-1])
    if lo == 0 and hi == len(lists.values):
        return lists
    return pa.LargeListArray.from_arrays(pa.array(offsets - lo), lists.values.slice(lo, hi - lo))


def _numpy_views(lists) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list array as read-only zero-copy numpy arrays."""
    return lists.offsets.to_numpy(), lists.values.to_numpy()


# -- Arrow / Parquet -------------------------------------------------------------------------------
def _schema(with_times: bool):
    import pyarrow as pa

    fields = [
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("prompt_uid", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("response_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("instance", pa.string(), nullable=True),
        pa.field("submit_s", pa.float64(), nullable=False),
        pa.field("finish_s", pa.float64(), nullable=False),
    ]
    if with_times:
        fields.append(pa.field("token_times", pa.large_list(pa.float32()), nullable=False))
    return pa.schema(fields)


def to_table(trace: Trace):
    """The trace as a ``pyarrow.Table`` with the format's schema and metadata (the token lists
    are the trace's own Arrow arrays)."""
    import pyarrow as pa

    trace.validate()
    arrays = [
        pa.array(trace.epoch),
        pa.array(trace.step),
        pa.array(trace.prompt_uid, type=pa.string()),
        pa.array(trace.sample_index),
        trace.prompt_lists,
        trace.response_lists,
        pa.array(trace.reward),
        pa.array(trace.finish_reason, type=pa.string()),
        pa.array(trace.instance, type=pa.string(), from_pandas=False),
        pa.array(trace.submit_s),
        pa.array(trace.finish_s),
    ]
    with_times = trace.token_time_lists is not None
    if with_times:
        arrays.append(trace.token_time_lists)
    metadata = {
        _KEY_FORMAT: TRACE_FORMAT.encode(),
        _KEY_VERSION: str(TRACE_VERSION).encode(),
        _KEY_META: json.dumps(trace.meta, sort_keys=True).encode(),
    }
    return pa.Table.from_arrays(arrays, schema=_schema(with_times).with_metadata(metadata))


def write_trace(trace: Trace, path) -> None:
    """Write ``trace`` to ``path`` (Parquet, zstd) atomically: a temporary file in the same
    directory is renamed over ``path`` only once it is complete."""
    import pyarrow.parquet as pq

    path = Path(path)
    table = to_table(trace)
    path.parent.mkdir(parents=True, exist_ok=True)
    # like mkstemp, but with the usual permissions (0666 & ~umask) for the final file
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise FileExistsError(f"could not create a temporary file next to {path}")
    try:
        pq.write_table(
            table,
            tmp,
            compression="zstd",
            # token columns: dictionary encoding and statistics cost time and buy nothing
            use_dictionary=["prompt_uid", "finish_reason", "instance"],
            write_statistics=["epoch", "step", "sample_index"],
        )
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_trace(path) -> Trace:
    """Read and validate a trace; every problem is a ``TraceFormatError`` naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    where = str(path)
    if not path.exists():
        raise TraceFormatError(f"{where}: no such trace file")
    if not path.is_file():
        raise TraceFormatError(f"{where}: not a file")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{where}: not a readable Parquet file ({exc})") from None
    md = schema.metadata or {}
    fmt = md.get(_KEY_FORMAT)
    if fmt is None:
        raise TraceFormatError(
            f"{where}: not a {TRACE_FORMAT} file (its Parquet metadata has no '{_KEY_FORMAT.decode()}' key)"
        )
    if fmt.decode(errors="replace") != TRACE_FORMAT:
        raise TraceFormatError(f"{where}: format '{fmt.decode(errors='replace')}' is not '{TRACE_FORMAT}'")
    raw_version = md.get(_KEY_VERSION, b"").decode(errors="replace")
    try:
        version = int(raw_version)
    except ValueError:
        raise TraceFormatError(
            f"{where}: unreadable trace format version {raw_version!r} (this reader supports version {TRACE_VERSION})"
        ) from None
    if version != TRACE_VERSION:
        raise TraceFormatError(
            f"{where}: trace format version {version} is not supported (this reader supports version {TRACE_VERSION})"
        )
    try:
        meta = json.loads(md.get(_KEY_META, b"{}").decode())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise TraceFormatError(f"{where}: corrupt trace metadata ({exc})") from None
    missing = [c for c in COLUMNS if c not in schema.names]
    if missing:
        raise TraceFormatError(f"{where}: missing column(s) {missing}")
    columns = list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in schema.names]
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{where}: corrupt Parquet data ({exc})") from None
    trace = _from_table(table, meta, where)
    trace._check(where, ids=False)  # _from_table checked the ids
    return trace


def _from_table(table, meta: dict, where: str) -> Trace:
    import pyarrow as pa

    def fail(msg: str):
        raise TraceFormatError(f"{where}: {msg}")

    def column(name):
        col = table.column(name)
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)

    def scalar(name, dtype, nullable_ok=False):
        arr = column(name)
        if arr.null_count and not nullable_ok:
            fail(f"column '{name}' has {arr.null_count} null value(s)")
        values = arr.to_numpy(zero_copy_only=False)
        kind = np.dtype(dtype).kind
        if (kind == "i" and values.dtype.kind not in "iu") or (kind == "f" and values.dtype.kind not in "iuf"):
            fail(f"column '{name}' has type {arr.type}, expected {np.dtype(dtype).name}")
        if kind == "i" and values.size:
            info = np.iinfo(dtype)
            if values.min() < info.min or values.max() > info.max:
                fail(f"column '{name}' has values outside the {np.dtype(dtype).name} range")
        return values.astype(dtype, copy=False)

    def strings(name, nullable=False):
        arr = column(name)
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) or pa.types.is_null(arr.type)):
            fail(f"column '{name}' has type {arr.type}, expected string")
        if arr.null_count and not nullable:
            fail(f"column '{name}' has {arr.null_count} null value(s)")
        return _object_array(arr.to_numpy(zero_copy_only=False))

    def lists(name, value_type, ids: bool):
        arr = column(name)
        if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
            fail(f"column '{name}' has type {arr.type}, expected a list")
        if arr.null_count:
            fail(f"column '{name}' has {arr.null_count} null row(s)")
        values = arr.flatten()  # the rows' values (a slice of the child array, no copy)
        if values.null_count:
            fail(f"column '{name}' has null values inside its lists")
        if ids:
            if not pa.types.is_integer(values.type):
                fail(f"column '{name}' holds {values.type}, expected integer token ids")
            _check_ids(values.to_numpy(), name, where)  # before narrowing to int32
        elif not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            fail(f"column '{name}' holds {values.type}, expected numbers")
        target = pa.large_list(value_type)
        return arr if arr.type == target else arr.cast(target, safe=False)

    prompts = lists("prompt_ids", pa.int32(), ids=True)
    responses = lists("response_ids", pa.int32(), ids=True)
    times = lists("token_times", pa.float32(), ids=False) if "token_times" in table.column_names else None
    return Trace._from_lists(
        epoch=scalar("epoch", np.int32),
        step=scalar("step", np.int32),
        prompt_uid=strings("prompt_uid"),
        sample_index=scalar("sample_index", np.int32),
        reward=scalar("reward", np.float32),
        finish_reason=strings("finish_reason"),
        instance=strings("instance", nullable=True),
        submit_s=scalar("submit_s", np.float64),
        finish_s=scalar("finish_s", np.float64),
        prompt_lists=prompts,
        response_lists=responses,
        token_time_lists=times,
        meta=meta,
    )
