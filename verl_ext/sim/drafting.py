"""Speculative decoding in the simulator: exact-match replay with the real draft index.

The drafter proposes from the same native ``DraftIndex`` the vLLM drafter uses, with the
same options (``SpecOptions``). A drafted token is accepted iff it equals the trace's next
token, and every step also emits the target's own next token. For one-hot (model-free)
drafts this is the acceptance law of the engine's rejection sampler: a greedy target accepts
exactly the tokens it would have produced, and at temperature > 0 a drafted token d is kept
with probability p(d), the probability that the target samples d (the trace holds one such
sample). Three modes, all calling ``DraftIndex.replay``:

* ``cached`` (request and history scopes): a request's drafts depend only on its own context
  and the (fixed within a rollout) history trees, so its whole step schedule (tokens emitted
  and drafted per step) is replayed natively once, when the request is first admitted. Exact.
* ``lockstep`` (group scope, the default there): drafts also depend on how far the group's
  other responses have got. Each group is replayed once, up front (``precompute``: in worker
  processes for large workloads), with all of its responses advancing one step per round. Exact when the group's requests run
  concurrently at equal step rates (as under ``baseline``); an approximation otherwise. Its
  error against ``exact`` is measured in docs/BENCHMARKS.md.
* ``exact``: one shared index; each simulated engine step replays one step of its batch, so
  group trees see exactly the tokens emitted so far anywhere in the cluster (an ideal,
  zero-latency grouped draft server). One event per engine step: for validation-sized runs.

Workload-aware selection (``SpecOptions.select``, RLHFSpec section 5) needs ``exact`` (the
default with it): every step the instance's ``DraftSelector`` cuts the batch's candidate drafts
(``k`` tokens each) to its choice, exactly as the engine proposer does, and learns from what was
accepted.

Adaptive draft length (``SpecOptions.adaptive``, Seer section 4.4): each step of a simulated
instance caps every running request's draft at ``verl_ext.spec.adaptive.draft_caps`` of the
batch size and of the fraction of the request's group that has completely finished anywhere in
the cluster. The drafter, shared by all instances, keeps those finishes (``response_done``,
``finished_fraction``) and tells the instances running a sibling (``attach``) so that their
current plans end at the next step boundary. ``exact`` proposes at most the cap. ``cached`` and
``lockstep`` replay schedules drafted with the full ``k``; the instance splits a step whose draft
exceeds the cap (``split_schedule``). That is an approximation: it assumes that the drafter,
re-proposing from the longer context after a capped step, continues the same accepted run.

Per-request drafting (``GenRequest.extra``, as the vLLM proposer reads it): ``spec_window`` caps
the request's drafts in every mode (the instance's draft cap: 0 = plain decoding);
``spec_scopes`` narrows its scopes in ``exact`` mode only (``cached`` and ``lockstep`` replay with
the drafter's scopes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

import numpy as np

from verl_ext.engine.instance import GenRequest
from verl_ext.history.store import history_weight
from verl_ext.sim.source import Target, TraceSource
from verl_ext.spec import SCOPE_GLOBAL, SCOPE_GROUP, SCOPE_HISTORY, match_lengths
from verl_ext.spec.options import SpecOptions, request_drafting
from verl_ext.spec.select import cumulative_scores

MODES = ("auto", "cached", "lockstep", "exact")
_MAX_BATCHES = 1024  # exact mode's cached batches (``ReplayDrafter._batch``), one per instance in use


def replay_mode(spec: SpecOptions, mode: str = "auto") -> str:
    """The mode ``auto`` stands for with ``spec``: ``exact`` for workload-aware selection and the
    global scope, else ``lockstep`` with the group scope, else ``cached``; other modes as given."""
    if mode != "auto":
        return mode
    return "exact" if spec.select or spec.mask & SCOPE_GLOBAL else "lockstep" if spec.mask & SCOPE_GROUP else "cached"


class ReplayDrafter:
    def __init__(self, spec: SpecOptions, source: TraceSource, mode: str = "auto", history=None,
                 preload: bool = True, max_bytes: Optional[int] = None):
        """``history``: (trace, rows) of the previous epoch, for the history and global scopes
        (the global tree starts with its responses, as an engine that ran it); each response
        is added to its prompt's history tree with weight ``history_weight(reward)``: all at once
        (``preload``), or per step through ``load_histories`` / ``drop_histories`` (what engines
        hold: the histories of the prompts they serve now). ``max_bytes``: the index's memory cap
        (default ``spec.max_bytes``, one engine's)."""
        if mode not in MODES:
            raise ValueError(f"unknown replay mode '{mode}'; valid: {list(MODES)}")
        self.spec = spec
        self.mask = spec.mask
        mode = replay_mode(spec, mode)
        if spec.select and mode != "exact":
            raise ValueError("workload-aware selection (spec select) decides every step from the step's drafts; "
                             f"it needs replay mode 'exact', not '{mode}'")
        if mode == "cached" and self.mask & SCOPE_GROUP:
            raise ValueError("replay mode 'cached' cannot draft from the group scope; use lockstep or exact")
        if mode != "exact" and self.mask & SCOPE_GLOBAL:  # its tree depends on every group's order
            raise ValueError(f"replay mode {mode!r} cannot draft from the global scope; use exact")
        self.mode = mode
        self.source = source
        #: the history trees are loaded per step (``load_histories``) rather than all at once
        self.lazy_history = False
        self.index = spec.new_index(max_bytes)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._resp_len = source.trace.response_lengths()
        self._finished: dict[str, set[int]] = {}  # group -> sample indices whose whole response is out
        self._fractions: dict[str, float] = {}  # group -> the share of its responses in ``_finished``
        self._listeners: list = []  # instances told when a response finishes (adaptive drafting)
        self._rows: dict[str, np.ndarray] = {}
        self._ends: dict[str, int] = {}
        #: exact mode: the index key of each started request. A request that comes back (a later
        #: chunk, or a resubmission) is a new engine request with its own group sequence, as in
        #: the vLLM drafter, so each start gets a fresh key.
        self._ik: dict[str, str] = {}
        self._masks: dict[str, int] = {}  # exact mode: keys whose request narrowed the scopes
        self._starts = 0
        #: exact mode: per batch (keyed by its key list's id; the list itself is kept, so the id
        #: stays its own) the index keys, rows and ends. A batch's requests keep their index keys
        #: until one of them starts or leaves, which clears every entry.
        self._batches: dict[int, tuple[list, list, list, np.ndarray]] = {}
        self._aimd = spec.aimd_windows()  # exact mode's per-request windows (replay keeps its own)
        self._aimd_at: dict[str, tuple[int, int]] = {}  # key -> (position observed at, window before)
        if self.mask & SCOPE_GLOBAL and history is not None:
            # an engine that ran the epoch before holds its responses in its global tree (as many
            # as the tree's two generations keep), the last to finish newest
            trace, rows = history
            for i in rows:
                self.index.add_global(trace.response(i).astype(np.int32))
        if self.mask & SCOPE_HISTORY:
            if history is None:
                raise ValueError("the history scope needs an earlier epoch in the trace")
            trace, rows = history
            self._history = (trace, {})
            for i in rows:
                self._history[1].setdefault(str(trace.prompt_uid[i]), []).append(int(i))
            if preload or mode == "lockstep":  # lockstep replays every group up front
                self.load_histories(self._history[1])
            else:
                self.lazy_history = True

    def load_histories(self, uids) -> None:
        """Add the history trees of ``uids`` (prompts without history are skipped)."""
        trace, rows = self._history
        for u in uids:
            for i in rows.get(u, ()):
                self.index.add_history(u, trace.response(i), history_weight(float(trace.reward[i])))

    def drop_histories(self, uids) -> None:
        for u in uids:
            self.index.drop_history(u)

    @property
    def per_step(self) -> bool:
        return self.mode == "exact"

    # -- group progress (adaptive drafting) ------------------------------------------------
    def attach(self, instance) -> None:
        """``instance.group_finished(group)`` is called whenever a response of ``group`` finishes."""
        self._listeners.append(instance)

    def response_done(self, request: GenRequest, target: Target, emitted: int) -> bool:
        """``request`` left its instance after emitting ``emitted`` of ``target``'s tokens; if that
        was the last token of its trace response (not just of a chunk), count its group's
        response as finished and tell the attached instances. Returns whether it was."""
        offset = target.prompt_len - self.source.prompt_len(target.row)
        if offset + emitted < int(self._resp_len[target.row]):
            return False
        done = self._finished.setdefault(request.group_id, set())
        if request.sample_index in done:
            return True
        done.add(request.sample_index)
        self._fractions[request.group_id] = len(done) / max(1, len(self.source.group_rows(request.group_id)))
        for inst in self._listeners:
            inst.group_finished(request.group_id)
        return True

    def finished_fraction(self, groups) -> np.ndarray:
        """Per group id: responses completely finished / responses of the group in the trace."""
        get = self._fractions.get
        return np.fromiter((get(g, 0.0) for g in groups), dtype=np.float64, count=len(groups))

    def _start(self, key: str, request: GenRequest, prompt: np.ndarray, mask: Optional[int] = None) -> None:
        mask = self.mask if mask is None else mask
        group = request.group_id if mask & SCOPE_GROUP else ""
        history = request.history_key if mask & SCOPE_HISTORY else ""
        self.index.start_request(key, prompt, group=group, history=history, scopes=mask)

    def _replay(self, keys, rows, starts, ends, max_steps=-1, mask: Optional[int] = None):
        s = self.spec
        return self.index.replay(keys, rows, starts, ends, s.k, scopes=self.mask if mask is None else mask,
                                 min_match=s.min_match, max_match=s.max_match, min_prob=s.min_prob,
                                 scope_weights=s.scope_weights,
                                 max_steps=max_steps, aimd_start=s.aimd_start if s.aimd else 0,
                                 aimd_step=s.aimd_step)

    # -- cached and lockstep: a whole schedule per request --------------------------------
    def schedule(self, key: str, request: GenRequest, target: Target,
                 history_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(tokens emitted per step, tokens drafted per step) for ``target``'s tokens.
        ``history_from``: the engine gets the prompt's history tree only once the request has
        emitted that many tokens (its build was still running; ``SimInstance.drafter_call``):
        ``cached`` mode replays the tokens before without the history scope (the split at a
        step boundary restarts AIMD's window, an approximation); ``lockstep`` ignores it."""
        if self.mode == "cached":
            prompt = np.asarray(request.prompt_ids, dtype=np.int32)
            row = np.concatenate([prompt, target.tokens]).astype(np.int32, copy=False)
            cut = len(prompt) + max(0, int(history_from)) if self.mask & SCOPE_HISTORY else len(prompt)
            pieces = []
            for start, end, mask in ((len(prompt), min(cut, len(row)), self.mask & ~SCOPE_HISTORY),
                                     (min(cut, len(row)), len(row), self.mask)):
                if end <= start:
                    continue
                self._start(key, request, row[:start], mask)
                try:
                    pieces.append(self._replay([key], [row], [start], [end], mask=mask)[0])
                finally:
                    self.index.finish(key)
            if len(pieces) < 2:
                return pieces[0] if pieces else (np.zeros(0, np.int32), np.zeros(0, np.int32))
            return tuple(np.concatenate(part) for part in zip(*pieces))
        return self._lockstep(key, request, target)

    def _lockstep(self, key, request, target):
        ck = f"{request.group_id}\x00{request.sample_index}"
        if ck not in self._cache:
            self._cache.update(self._replay_group(request.group_id))
        emitted, drafted = self._cache[ck]
        # A continuation (chunked rollout) starts part-way into the response: skip the steps
        # before its offset; a step that straddles the offset is cut (an approximation).
        offset = len(request.prompt_ids) - self.source.prompt_len(target.row)
        if offset + len(target.tokens) >= len(self.source.trace.response(target.row)):
            del self._cache[ck]  # the last piece of this response
        cum = np.cumsum(emitted)
        first = int(np.searchsorted(cum, offset, side="right"))
        prev = int(cum[first - 1]) if first > 0 else 0
        emitted, drafted = emitted[first:].copy(), drafted[first:].copy()
        if len(emitted) and prev < offset:
            emitted[0] = int(cum[first]) - offset
        return _clip(emitted, drafted, len(target.tokens))

    def _replay_group(self, group: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Lockstep replay of one group (prompt uid): schedules keyed group + sample index."""
        keys, rows, starts = [], [], []
        scope_group = group if self.mask & SCOPE_GROUP else ""
        scope_history = group if self.mask & SCOPE_HISTORY else ""
        for i in self.source.group_rows(group):
            k = f"{group}\x00{int(self.source.trace.sample_index[i])}"
            prompt = self.source.trace.prompt(i)
            keys.append(k)
            rows.append(self.source.full_row(i))
            starts.append(len(prompt))
            self.index.start_request("lockstep\x00" + k, prompt, group=scope_group, history=scope_history, scopes=self.mask)
        try:
            out = self._replay(["lockstep\x00" + k for k in keys], rows, starts, [len(r) for r in rows])
        finally:
            for k in keys:
                self.index.finish("lockstep\x00" + k)
            self.index.drop_group(group)
        # emitted <= k + 1 and drafted <= k, k <= 128: one byte each
        return {k: (e.astype(np.uint8), d.astype(np.uint8)) for k, (e, d) in zip(keys, out)}

    def precompute(self, workers: Optional[int] = None) -> None:
        """Lockstep mode: replay every group up front. Groups are independent here, so large
        workloads are split over worker processes (forked: they share the trace and the
        history trees); the schedules are the same as replaying one group at a time."""
        if self.mode != "lockstep":
            return
        groups = self.source.groups()
        workers = workers or os.cpu_count() or 1
        if workers < 2 or len(groups) < 16 * workers or "fork" not in mp.get_all_start_methods():
            for g in groups:
                self._cache.update(self._replay_group(g))
            return
        global _FORKED
        _FORKED = self
        try:
            chunks = [groups[i::workers * 4] for i in range(workers * 4)]
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
                for part in ex.map(_replay_groups, chunks):
                    self._cache.update(part)
        finally:
            _FORKED = None

    # -- exact: one shared index, one step at a time --------------------------------------
    def started(self, key: str) -> bool:
        return key in self._rows

    def start(self, key: str, request: GenRequest, target: Target) -> None:
        prompt = np.asarray(request.prompt_ids, dtype=np.int32)
        self._rows[key] = np.concatenate([prompt, target.tokens]).astype(np.int32, copy=False)
        self._ends[key] = len(self._rows[key])
        self._starts += 1
        self._ik[key] = f"{key}\x00{self._starts}"
        self._batches.clear()
        # per-request scopes (``spec_scopes``, as the vLLM proposer reads them; the window is the
        # instance's draft cap); only exact mode drafts per request
        mask, _ = request_drafting(request.extra, self.mask)
        if mask != self.mask:
            self._masks[key] = mask
        self._start(self._ik[key], request, prompt, mask)

    def step(self, keys: list[str], positions: np.ndarray, caps: Optional[np.ndarray] = None, selector=None,
             kv_tokens: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """One engine step for the batch ``keys`` whose contexts end at ``positions`` (prompt +
        tokens emitted so far): (emitted, drafted) per request. Idempotent until the step's
        tokens are emitted (the instance may re-plan a step it has not run), because it only
        brings the index up to ``positions`` and proposes. ``caps``: most draft tokens per
        request (adaptive drafting); default ``spec.k`` each. ``selector``: the instance's
        ``DraftSelector`` (RLHFSpec), which cuts the step's drafts to its choice for a batch
        holding ``kv_tokens`` KV tokens and learns from what the target accepted."""
        s = self.spec
        if selector is not None:
            return self._step_selected(keys, positions, caps, selector, kv_tokens)
        emitted = np.empty(len(keys), dtype=np.int64)
        drafted = np.empty(len(keys), dtype=np.int64)
        self.last_scopes = scopes = np.zeros(len(keys), dtype=np.int64)
        positions = positions.tolist()
        ks = [s.k] * len(keys) if caps is None else [min(int(c), s.k) for c in caps]
        windows = None
        if self._aimd is not None:  # a re-planned step (same position) uses the window it had
            at = self._aimd_at.get
            windows = [a[1] if (a := at(key)) is not None and a[0] == pos else self._aimd.get(key)
                       for key, pos in zip(keys, positions)]
            ks = [min(k, w) for k, w in zip(ks, windows)]
        for key, pos in zip(keys, positions):  # the batch's tokens so far, before any proposal
            self._sync(key, pos)
        for j, (key, pos) in enumerate(zip(keys, positions)):
            row, end = self._rows[key], self._ends[key]
            if ks[j] <= 0:  # no draft this step: plain decoding
                emitted[j], drafted[j] = 1, 0
                continue
            (toks, _, _, _), scopes[j] = self.index.propose(self._ik[key], ks[j], context=row[:pos],
                                                   scopes=self._masks.get(key, self.mask),
                                                   min_match=s.min_match, max_match=s.max_match,
                                                   min_prob=s.min_prob, scope_weights=s.scope_weights)
            left = end - pos
            nxt = row[pos: pos + min(len(toks), left - 1)]
            same = toks[: len(nxt)] == nxt
            acc = len(nxt) if same.all() else int(np.argmin(same))
            emitted[j] = min(acc + 1, left)
            drafted[j] = len(toks)
            if windows is not None and self._aimd_at.get(key, (-1,))[0] != pos:
                self._aimd_at[key] = (pos, windows[j])
                self._aimd.observe(key, len(toks), acc)
        return emitted, drafted

    def _step_selected(self, keys, positions, caps, selector, kv_tokens):
        s = self.spec
        pos = np.asarray(positions, dtype=np.int64)
        _, iks, rows, ends = self._batch(keys)
        self.index.sync_rows(iks, rows, pos)
        left = ends - pos
        ks = np.full(len(keys), s.k, dtype=np.int64) if caps is None else np.minimum(np.asarray(caps, dtype=np.int64), s.k)
        if not ks.any():  # a step the cut-off keeps plain: the engine's drafter selects nothing either
            self.last_scopes = np.zeros(len(keys), dtype=np.int64)
            return np.minimum(1, left), np.zeros(len(keys), dtype=np.int64)
        toks, n, probs, scope = self.index.batch_propose(iks, ks, scopes=self.mask, min_match=s.min_match,
                                                         max_match=s.max_match, min_prob=s.min_prob,
                                                         scope_weights=s.scope_weights)
        self.last_scopes = scope.astype(np.int64)
        scores = cumulative_scores(probs, n)
        lengths, _ = selector.select_lengths(scores, n, kv_tokens)
        lengths = lengths.astype(np.int64)
        # the target accepts the longest selected prefix equal to the trace's next tokens (never its last token)
        acc = match_lengths(toks, np.minimum(lengths, left - 1), rows, pos)
        selector.observe(scores, lengths, acc)
        return np.minimum(acc + 1, left), lengths

    def _batch(self, keys: list) -> tuple[list, list, list, np.ndarray]:
        """(keys, index keys, rows, ends) of the batch ``keys``, cached while the batch runs: the
        caller passes the same list object for as long as its batch is unchanged."""
        got = self._batches.get(id(keys))
        if got is None or got[0] is not keys:
            if len(self._batches) >= _MAX_BATCHES:  # callers that pass a new list every step
                self._batches.clear()
            ends = np.fromiter((self._ends[k] for k in keys), dtype=np.int64, count=len(keys))
            got = self._batches[id(keys)] = (keys, [self._ik[k] for k in keys], [self._rows[k] for k in keys], ends)
        return got

    def _sync(self, key: str, pos: int) -> None:
        ik = self._ik[key]
        have = self.index.context_length(ik)
        if have < pos:
            self.index.append(ik, self._rows[key][have:pos])

    def drop(self, key: str) -> None:
        """Forget ``key`` without syncing it (a request that left before running again)."""
        if key in self._rows:
            self._batches.clear()
            del self._rows[key], self._ends[key]
            self._masks.pop(key, None)
            self.index.finish(self._ik.pop(key))
            if self._aimd is not None:
                self._aimd.drop(key)
                self._aimd_at.pop(key, None)

    def finish(self, key: str, pos: int) -> None:
        """The request left its instance with its context ending at ``pos``."""
        if key in self._rows:
            self._sync(key, pos)
            self.drop(key)


_FORKED: Optional[ReplayDrafter] = None  # the drafter a forked precompute worker replays with


def _replay_groups(groups: list[str]) -> dict:
    out = {}
    for g in groups:
        out.update(_FORKED._replay_group(g))
    return out


def split_schedule(emitted: np.ndarray, drafted: np.ndarray, cap: int):
    """Replay steps ``(emitted, drafted)`` with at most ``cap`` draft tokens per step.

    A step that drafted ``d > cap`` tokens and emitted ``e`` is split: each piece drafts
    ``min(d_left, cap)`` and emits ``min(e_left, cap + 1)`` (all its drafts accepted plus the
    target's token), until the step's ``e`` tokens are out; a step within the cap is kept.
    Returns ``(emitted, drafted, step, piece)`` per resulting step, where ``step`` is the index
    of the original step and ``piece`` the piece's index within it (int64 arrays). Emitted
    tokens are conserved exactly. The approximation: the capped drafter is assumed to re-propose
    the continuation of the run it would have drafted with the full ``k``."""
    e = np.asarray(emitted, dtype=np.int64)
    d = np.asarray(drafted, dtype=np.int64)
    c = max(0, int(cap))
    m = np.maximum(1, -(-e // (c + 1)))  # pieces per step
    step = np.repeat(np.arange(len(e)), m)
    starts = np.cumsum(m) - m
    piece = np.arange(int(m.sum())) - np.repeat(starts, m)
    er, dr, mr = e[step], d[step], m[step]
    out_e = np.where(piece < mr - 1, c + 1, er - piece * (c + 1))
    out_d = np.clip(dr - piece * c, 0, c)
    return out_e, out_d, step, piece


def split_schedules(emitted: np.ndarray, drafted: np.ndarray, caps: np.ndarray):
    """``split_schedule`` for a batch: ``emitted``/``drafted`` are (B, W) windows of B
    requests' schedules, ``caps`` their caps. Returns ``(E, D, step, piece, pieces)``: the first
    ``n`` capped steps of every request (``E``, ``D``: (B, n), ``n`` = the fewest pieces of any
    request), for every request the original step and piece index of its capped steps
    ``0..n`` (``step``, ``piece``: (B, n + 1); where a request has only ``n`` pieces, column
    ``n`` is meaningless), and each request's number of pieces (``pieces``: (B,))."""
    e = np.asarray(emitted, dtype=np.int64)
    d = np.asarray(drafted, dtype=np.int64)
    B, W = e.shape
    c = np.maximum(np.asarray(caps, dtype=np.int64), 0)
    m = np.maximum(1, -(-e // (c[:, None] + 1))).ravel()  # pieces per (request, step)
    pieces = m.reshape(B, W).sum(axis=1)
    n = int(pieces.min())
    src = np.repeat(np.arange(B * W), m)  # flat (request, step) of every piece
    piece = np.arange(len(src)) - np.repeat(np.cumsum(m) - m, m)
    cr = c[src // W]
    mr = m[src]
    out_e = np.where(piece < mr - 1, cr + 1, e.ravel()[src] - piece * (cr + 1))
    out_d = np.clip(d.ravel()[src] - piece * cr, 0, cr)
    first = np.cumsum(pieces) - pieces
    idx = np.minimum(first[:, None] + np.arange(n + 1), len(src) - 1)
    return out_e[idx[:, :n]], out_d[idx[:, :n]], src[idx] % W, piece[idx], pieces


def _clip(emitted: np.ndarray, drafted: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut a schedule so that it emits exactly ``total`` tokens."""
    cum = np.cumsum(emitted)
    n = int(np.searchsorted(cum, total, side="left")) + 1
    emitted, drafted = emitted[:n].copy(), drafted[:n].copy()
    if n and cum[n - 1] > total:
        emitted[-1] -= cum[n - 1] - total
    return emitted, drafted


def make_drafter(spec: Optional[SpecOptions], source: TraceSource, mode: str = "auto", history=None, **kw):
    if spec is None:
        return None
    drafter = ReplayDrafter(spec, source, mode, history, **kw)
    drafter.precompute()
    return drafter
