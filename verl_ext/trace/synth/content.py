"""Token content of a synthetic workload. ``synthesize(cfg, source)``: a ``Trace``, rows ordered
(epoch, prompt, sample), ``step == epoch``, lengths from ``lengths.sample_lengths``, tokens that
are real responses of ``source`` (``load_source``: the committed SmolLM2 trace) spliced chapter by
chapter and relabelled per unit, then partly overwritten, per ``segment_len`` tokens, by copies
of the group's template sibling, of the previous-epoch response the response follows and of its
own earlier text (the ``*_similarity`` knobs; ``shared_path`` and ``self_from_history`` tie them
together), each copied token put back to the response's own at the ``*_edit_rate`` knobs. The
same config and source give the same arrays. The knobs are fitted per scope to the papers'
drafting statistics (``calibration``). The construction and its limits: docs/SIMULATOR.md,
"Synthetic workloads"."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np

from verl_ext.trace.format import Trace
from verl_ext.trace.synth.calibration import level_of
from verl_ext.trace.synth.config import SynthConfig
from verl_ext.trace.synth.lengths import sample_lengths

REPO = Path(__file__).resolve().parents[3]
COMMITTED_TRACE = REPO / "data" / "traces" / "smollm2_arith_e2.parquet"
REPLAY_JSON = REPO / "data" / "replay_smollm2_arith.json.gz"

_KINDS_BASE, _KINDS_HISTORY, _KINDS_SIBLING, _KINDS_SELF = 0, 1, 2, 3


def default_source_path() -> Path:
    """The committed real trace if present, else the replay data it supersedes."""
    return COMMITTED_TRACE if COMMITTED_TRACE.exists() else REPLAY_JSON


def load_source(path=None) -> Trace:
    """A real trace to draw tokens from: a ``verl_ext.trace`` Parquet file, or the replay
    layout of ``scripts/make_replay_data.py`` (``.json.gz``: seeds become epochs)."""
    path = Path(path) if path is not None else default_source_path()
    if path.suffix != ".gz":
        from verl_ext.trace.format import read_trace

        return read_trace(path)
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    rows = []
    for e, (epoch, rewards) in enumerate(zip(d["epochs"], d["rewards"])):
        for p, (group, rew) in enumerate(zip(epoch, rewards)):
            for j, (resp, r) in enumerate(zip(group, rew)):
                rows.append({
                    "epoch": e, "prompt_uid": f"p{p}", "sample_index": j, "prompt_ids": d["prompts"][p],
                    "response_ids": resp, "reward": float(r),
                    "finish_reason": "length" if len(resp) >= d.get("args", {}).get("max_tokens", 1 << 30) else "stop",
                })
    return Trace.from_rows(rows, meta={"source": "real", "model": d.get("model"), "created": d.get("created"), "file": path.name})


class _Source:
    """The source trace arranged as units: rows[e_src][sp, s] -> trace row."""

    def __init__(self, trace: Trace, seed: int):
        if len(trace) == 0:
            raise ValueError("source trace is empty")
        lens = trace.response_lengths()
        keep = lens > 0
        epochs = sorted(set(trace.epoch[keep].tolist()))
        uids_by_epoch = []
        for e in epochs:
            m = keep & (trace.epoch == e)
            uids_by_epoch.append(set(trace.prompt_uid[m].tolist()))
        common = set.intersection(*uids_by_epoch)
        order = []
        seen = set()
        for u in trace.prompt_uid[keep].tolist():  # first-appearance order
            if u in common and u not in seen:
                seen.add(u)
                order.append(u)
        if not order:
            raise ValueError("source trace has no prompt with a non-empty response in every epoch")
        self.uids = order
        self.S = len(order)
        self.E = len(epochs)
        uid_index = {u: i for i, u in enumerate(order)}
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in np.flatnonzero(keep).tolist():
            u = trace.prompt_uid[i]
            if u in uid_index:
                groups.setdefault((epochs.index(int(trace.epoch[i])), uid_index[u]), []).append((int(trace.sample_index[i]), i))
        self.K = max(len(v) for v in groups.values())
        rows = np.zeros((self.E, self.S, self.K), np.int64)
        for (e, sp), v in groups.items():
            v.sort()
            idx = [i for _, i in v]
            rows[e, sp] = [idx[k % len(idx)] for k in range(self.K)]
        self.rows = rows
        self.trace = trace
        self.lens = lens.astype(np.int64)
        self.starts = trace.response_offsets[:-1].astype(np.int64)
        self.mean_len = float(self.lens[rows].mean())
        first = rows[0, :, 0]
        self.prompts = [trace.prompt(int(i)).astype(np.int32) for i in first]
        self.rewards = trace.reward
        tokens = trace.response_tokens
        vocab = np.unique(tokens)
        self.vocab = vocab
        self.V = int(vocab.size)
        rng = np.random.default_rng([seed, 7])
        order_v = vocab[rng.permutation(self.V)].astype(np.int32)
        pos = np.zeros(int(vocab[-1]) + 1, np.int32)
        pos[order_v] = np.arange(self.V, dtype=np.int32)
        self.src_pos = pos[tokens]  # token -> its place in the random order
        self.order2 = np.concatenate([order_v, order_v])  # order2[pos + shift], shift < V
        self.tokens = tokens

    def describe(self) -> dict:
        m = self.trace.meta or {}
        return {
            "rows": len(self.trace), "prompts": self.S, "epochs": self.E, "samples": self.K,
            "response_tokens": int(self.tokens.size), "vocab": self.V, "mean_response_len": round(self.mean_len, 1),
            "meta": {k: m[k] for k in ("source", "model", "created", "file", "workload") if k in m},
        }


def _expand(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``[starts[i], starts[i] + lens[i])`` (int64)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    cum = np.cumsum(lens) - lens
    return np.repeat(starts - cum, lens) + np.arange(total, dtype=np.int64)


class _Plan:
    """Per-epoch chapter tables and copy segments (docs/SIMULATOR.md, "Synthetic workloads")."""

    def __init__(self, cfg: SynthConfig, src: _Source, L: np.ndarray):
        self.cfg, self.src, self.L = cfg, src, L
        E, P, G = L.shape
        self.B = (G + src.K - 1) // src.K  # sample blocks per group
        rng = np.random.default_rng([cfg.seed, 2])
        self.sp0 = np.concatenate([rng.permutation(src.S) for _ in range(-(-P // src.S))])[:P]  # cycled
        self.base = rng.integers(0, 1 << 30, size=P)
        # output offsets: rows ordered (epoch, prompt, sample)
        flatL = L.reshape(-1)
        self.offsets = np.zeros(flatL.size + 1, np.int64)
        np.cumsum(flatL, out=self.offsets[1:])

    def units(self, p: np.ndarray, b: np.ndarray, m: np.ndarray, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(source prompt, relabel shift) of chapter ``m`` of block ``b`` of prompt ``p``."""
        src = self.src
        t = m * self.B + b
        sp = (self.sp0[p] + t) % src.S
        if not self.cfg.relabel or src.V < 2:
            return sp, np.zeros_like(t)
        fresh = e * 7919 if src.E == 1 else 0  # one-epoch source: new units each epoch
        shift = 1 + (self.base[p] + fresh + t) % (src.V - 1)  # one bijection per unit
        shift = np.where((t == 0) & (fresh == 0), 0, shift)
        return sp, shift

    def chapters(self, e: int, p: np.ndarray, j: np.ndarray, L: np.ndarray):
        """Chapter pieces of responses (e, p[i], j[i]) of lengths L[i]: per response, arrays of
        (source trace row, length, shift) in output order, plus the count per response."""
        src = self.src
        e_src = e % src.E
        rot = 0 if src.E == 1 else e // src.E
        s = (j % src.K + rot) % src.K
        b = j // src.K
        M = int(np.ceil(1.5 * L.max() / max(1.0, src.mean_len))) + 4
        while True:
            m = np.arange(M)
            sp, shift = self.units(p[:, None], b[:, None], m[None, :], e)
            rows = src.rows[e_src][sp, s[:, None]]
            clen = src.lens[rows]
            cum = np.cumsum(clen, axis=1)
            if (cum[:, -1] >= L).all():
                break
            M *= 2
        n_chap = (cum < L[:, None]).sum(axis=1) + 1
        valid = m[None, :] < n_chap[:, None]
        last = n_chap - 1
        before = np.where(last > 0, cum[np.arange(len(L)), np.maximum(last - 1, 0)], 0)
        plen = clen.copy()
        plen[np.arange(len(L)), last] = L - before
        return rows[valid], plen[valid], shift[valid], n_chap

    def fill_base(self, out: np.ndarray, e: int, chunk_tokens: int = 1 << 20) -> np.ndarray:
        """Writes the chapter content of epoch ``e``; returns its source rows of chapter 0."""
        cfg, src = self.cfg, self.src
        P, G = cfg.prompts, cfg.samples
        n = P * G
        first = np.zeros(n, np.int64)
        p_all = np.repeat(np.arange(P), G)
        j_all = np.tile(np.arange(G), P)
        L_all = self.L[e].reshape(-1)
        r0 = e * n
        i = 0
        while i < n:  # chunks of responses
            k = i + 1
            acc = int(L_all[i])
            while k < n and acc + L_all[k] <= chunk_tokens:
                acc += int(L_all[k])
                k += 1
            rows, plen, shift, n_chap = self.chapters(e, p_all[i:k], j_all[i:k], L_all[i:k])
            first[i:k] = rows[np.cumsum(n_chap) - n_chap]
            a, z = int(self.offsets[r0 + i]), int(self.offsets[r0 + k])
            idx = _expand(src.starts[rows], plen)
            if cfg.relabel and src.V >= 2:
                out[a:z] = src.order2[src.src_pos[idx] + np.repeat(shift.astype(np.int32), plen)]
            else:
                out[a:z] = src.tokens[idx]
            i = k
        return first

    def copies(self, e: int, rng: np.random.Generator):
        """Copy segments of epoch ``e``: (dst start, src start, length, kind), global offsets."""
        cfg = self.cfg
        P, G = cfg.prompts, cfg.samples
        n = P * G
        eps = cfg.epoch_similarity if e > 0 else 0.0
        gam = cfg.group_similarity if G > 1 else 0.0
        sig = cfg.self_similarity
        empty = (np.zeros(0, np.int64),) * 3 + (np.zeros(0, np.int8),)
        if eps + gam + sig <= 0:
            return empty
        seg = cfg.segment_len
        L = self.L[e].reshape(-1)
        nseg = -(-L // seg)
        resp = np.repeat(np.arange(n), nseg)
        k = np.arange(resp.size) - np.repeat(np.cumsum(nseg) - nseg, nseg)
        q = k * seg
        ln = np.minimum(seg, L[resp] - q)
        u = rng.random(resp.size)
        kind = np.select([u < eps, u < eps + gam, u < eps + gam + sig], [_KINDS_HISTORY, _KINDS_SIBLING, _KINDS_SELF],
                         _KINDS_BASE).astype(np.int8)
        kind[(kind == _KINDS_SELF) & (q < ln)] = _KINDS_BASE  # nothing earlier to repeat yet
        cont = np.zeros(resp.size, bool)
        cont[1:] = (kind[1:] == kind[:-1]) & (resp[1:] == resp[:-1])
        run = np.cumsum(~cont) - 1
        nrun = int(run[-1]) + 1 if run.size else 0
        run_first = np.flatnonzero(~cont)
        # the response each run copies from: one previous-epoch response per response (the
        # solution path it follows) and one template sibling per group, so that what one
        # response copies, its siblings hold too
        p = resp // G
        j = resp % G
        rng.integers(0, G, size=nrun)  # (draws kept: the stream of later draws stays the same)
        rng.integers(0, max(1, G - 1), size=nrun)
        paths = np.random.default_rng([cfg.seed, 6, e])
        h_all = paths.integers(0, G, size=n)
        sib_p = paths.integers(0, G, size=P)
        if cfg.shared_path > 0:  # the response follows its group template's path instead of its own
            share = np.random.default_rng([cfg.seed, 8, e]).random(n) < cfg.shared_path
            group = np.arange(n) // G
            h_all = np.where(share, h_all[group * G + sib_p[group]], h_all)
        h = h_all[resp[run_first]]
        sib = sib_p[p[run_first]]
        rk = kind[run_first]
        rk = np.where((rk == _KINDS_SIBLING) & (sib == j[run_first]), _KINDS_BASE, rk)  # the template keeps its text
        own = e * n + resp[run_first]
        src_row = np.select([rk == _KINDS_HISTORY, rk == _KINDS_SIBLING, rk == _KINDS_SELF],
                            [(e - 1) * n + p[run_first] * G + h, e * n + p[run_first] * G + sib, own], 0)
        Lsrc = self.L.reshape(-1)[src_row]
        q0 = q[run_first]
        start = np.floor(q0 / L[resp[run_first]] * Lsrc).astype(np.int64)  # aligned position
        # self: a run repeats earlier text of the response, [start, start + run length) < q0
        selfr = rk == _KINDS_SELF
        Lsrc = np.where(selfr, q0, Lsrc)
        start = np.where(selfr, np.floor(rng.random(nrun) * np.maximum(q0 - seg + 1, 1)).astype(np.int64), start)
        if cfg.self_from_history > 0:  # the run repeats one of the response's earlier history segments
            hist = kind == _KINDS_HISTORY
            upto = np.cumsum(hist)  # history segments up to and including each segment
            first = (np.cumsum(nseg) - nseg)[resp[run_first]]
            earlier = upto[first] - hist[first]  # history segments of responses before this one
            before = upto[run_first] - hist[run_first] - earlier
            pick = np.random.default_rng([cfg.seed, 9, e])
            redo = selfr & (before > 0) & (pick.random(nrun) < cfg.self_from_history)
            nth = earlier + np.floor(pick.random(nrun) * before).astype(np.int64) + 1
            start = np.where(redo, q[np.minimum(np.searchsorted(upto, nth), q.size - 1)], start)
        sel = (kind != _KINDS_BASE) & (rk[run] != _KINDS_BASE)
        r = run[sel]
        off = start[r] + (q[sel] - q0[r])
        lsel = ln[sel]
        room = Lsrc[r] - lsel + 1
        ok = room >= 1
        off = np.where(ok, off % np.maximum(room, 1), 0)
        dst = self.offsets[e * n + resp[sel]] + q[sel]
        srcs = self.offsets[src_row[r]] + off
        return dst[ok], srcs[ok], lsel[ok], kind[sel][ok]


def _apply(out: np.ndarray, dst: np.ndarray, srcs: np.ndarray, ln: np.ndarray, chunk_tokens: int = 1 << 20) -> None:
    """``out[dst_i : dst_i + ln_i] = out[src_i : ...]`` for all i, each chunk reading the buffer
    as it was before that chunk (numpy evaluates the gather before the scatter)."""
    if dst.size == 0:
        return
    cum = np.cumsum(ln)
    i = 0
    while i < dst.size:
        k = int(np.searchsorted(cum, (cum[i - 1] if i else 0) + chunk_tokens, side="right"))
        k = max(k, i + 1)
        out[_expand(dst[i:k], ln[i:k])] = out[_expand(srcs[i:k], ln[i:k])]
        i = k


def _edit(out: np.ndarray, base: np.ndarray, origin: int, dst: np.ndarray, ln: np.ndarray, rate: np.ndarray,
          rng: np.random.Generator, chunk_tokens: int = 1 << 20) -> int:
    """Each copied token (``out[dst_i : dst_i + ln_i]``) is, with probability ``rate_i``, put back
    to the response's own token (``base``: the epoch's text before the copies, starting at
    ``origin``). Returns how many were."""
    edited = 0
    cum = np.cumsum(ln)
    i = 0
    while i < dst.size:
        k = max(i + 1, int(np.searchsorted(cum, (cum[i - 1] if i else 0) + chunk_tokens, side="right")))
        pos = _expand(dst[i:k], ln[i:k])
        pos = pos[rng.random(pos.size) < np.repeat(rate[i:k], ln[i:k])]
        out[pos] = base[pos - origin]
        edited += int(pos.size)
        i = k
    return edited


def _prompts(cfg: SynthConfig, src: _Source, sp0: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    lo, hi = cfg.prompt_len
    out = []
    for p in range(cfg.prompts):
        real = src.prompts[int(sp0[p])]
        if hi == 0:
            out.append(real)
            continue
        n = int(rng.integers(lo, hi + 1))
        if len(real) >= n:
            out.append(real[len(real) - n:])
            continue
        parts, need, q = [], n - len(real), int(sp0[p])
        while need > 0:  # other real prompts in front (like few-shot examples)
            q = (q + 1) % src.S
            piece = src.prompts[q][:need]
            parts.append(piece)
            need -= len(piece)
        out.append(np.concatenate(parts + [real]).astype(np.int32))
    return out


def synthesize(cfg: SynthConfig, source: Trace) -> Trace:
    """A synthetic trace for ``cfg`` with tokens drawn from ``source`` (see the module docstring).
    Rows are ordered (epoch, prompt, sample); ``step == epoch``; ``meta`` records the config,
    the source and the solved length model."""
    t0 = time.perf_counter()
    if not isinstance(cfg, SynthConfig):
        raise TypeError("cfg must be a SynthConfig")
    src = _Source(source, cfg.seed)
    L, lm = sample_lengths(cfg)
    plan = _Plan(cfg, src, L)
    E, P, G = L.shape
    n = P * G
    out = np.empty(int(plan.offsets[-1]), np.int32)
    rng = np.random.default_rng([cfg.seed, 3])
    first = np.zeros(E * n, np.int64)
    copied = {"history": 0, "self": 0, "sibling": 0}
    edited = 0
    for e in range(E):
        first[e * n:(e + 1) * n] = plan.fill_base(out, e)
        dst, srcs, ln, kind = plan.copies(e, rng)
        rate = np.where(kind == _KINDS_HISTORY, cfg.epoch_edit_rate, cfg.group_edit_rate)
        base = out[plan.offsets[e * n]:plan.offsets[(e + 1) * n]].copy() if dst.size and rate.max() > 0 else None
        # history copies read epoch e-1 (final); self copies then read the response's text
        # before this pass, and sibling copies the group's template after its history and self
        # copies (the template has no sibling copies of its own)
        for name, kd in (("history", _KINDS_HISTORY), ("self", _KINDS_SELF), ("sibling", _KINDS_SIBLING)):
            m = kind == kd
            _apply(out, dst[m], srcs[m], ln[m])
            copied[name] += int(ln[m].sum())
        if base is not None:
            edited += _edit(out, base, int(plan.offsets[e * n]), dst, ln, rate, np.random.default_rng([cfg.seed, 5, e]))
    prompts = _prompts(cfg, src, plan.sp0, np.random.default_rng([cfg.seed, 4]))
    plens = np.array([len(x) for x in prompts], np.int64)
    p_rows = np.tile(np.repeat(np.arange(P), G), E)
    prompt_offsets = np.zeros(E * n + 1, np.int64)
    np.cumsum(plens[p_rows], out=prompt_offsets[1:])
    pflat = np.concatenate(prompts) if prompts else np.zeros(0, np.int32)
    poff = np.zeros(P + 1, np.int64)
    np.cumsum(plens, out=poff[1:])
    prompt_tokens = pflat[_expand(poff[p_rows], plens[p_rows])]
    uids = np.array([f"synth{cfg.seed}-p{p:06d}" for p in range(P)], dtype=object)
    Lf = L.reshape(-1)
    finish = np.where(Lf >= cfg.max_len, "length", "stop").astype(object)
    level = level_of(cfg)
    meta = {
        "source": "synthetic",
        "generator": "verl_ext.trace.synth",
        "synth": {
            "config": cfg.to_dict(),
            "similarity_level": level,
            "length_model": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in lm.items()},
            "copied_tokens": copied,
            "edited_tokens": edited,
            "seconds": round(time.perf_counter() - t0, 3),
        },
        "synth_source": src.describe(),
        "model": (source.meta or {}).get("model"),
    }
    trace = Trace(
        epoch=np.repeat(np.arange(E, dtype=np.int32), n),
        step=np.repeat(np.arange(E, dtype=np.int32), n),
        prompt_uid=uids[p_rows],
        sample_index=np.tile(np.arange(G, dtype=np.int32), E * P),
        prompt_tokens=prompt_tokens,
        prompt_offsets=prompt_offsets,
        response_tokens=out,
        response_offsets=plan.offsets,
        reward=np.nan_to_num(src.rewards[first], nan=0.0).astype(np.float32),
        finish_reason=finish,
        instance=np.full(E * n, None, dtype=object),
        submit_s=np.full(E * n, np.nan),
        finish_s=np.full(E * n, np.nan),
        meta=meta,
    )
    return trace
