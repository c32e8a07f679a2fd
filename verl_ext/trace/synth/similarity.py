"""The similarity measurement and the fit of the levels. ``similarity_stats(trace)``, on a real
or synthetic trace: RhymeRL §5.1's reuse fraction (response tokens whose 3-token prefix and token
occur in the prompt's previous-epoch responses) and Seer §3.3 / Table 2's grouped gain (accepted
draft tokens of exact-match replay with the native ``DraftIndex``, k = 8, with the group's other
responses as references vs the request alone), plus the history-scope gain. ``verl_ext.sim.calibration`` measures the levels of
``calibration.SIMILARITY_LEVELS`` with it (and with the simulator) against their targets.
``scope_replay(trace, spec)``: the tokens per step of a scope set (the global scope included) on
a trace's last epoch, every scope fed as the engine's drafter feeds it (issue 51: what each
scope and each combination is worth, ``scripts/bench_scopes.py``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from verl_ext.history.store import history_weight
from verl_ext.trace.format import Trace
from verl_ext.trace.synth.content import _expand
from verl_ext.trace.synth.lengths import _groups


_H1 = np.uint64(0x9E3779B97F4A7C15)
_H2 = np.uint64(0xC2B2AE3D27D4EB4F)


def _ngram_keys(trace: Trace, rows: np.ndarray, labels: np.ndarray, n_prefix: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """For each response token of ``rows``: a 64-bit hash of (label, previous ``n_prefix``
    tokens, the token), the context being the prompt's last ``n_prefix`` tokens + the response.
    Returns the keys and the row (position in ``rows``) of each key."""
    seqs = []
    for i in rows.tolist():
        pr = trace.prompt(i)[-n_prefix:]
        if len(pr) < n_prefix:
            pr = np.concatenate([np.full(n_prefix - len(pr), -1, np.int64), pr])
        seqs.append(pr.astype(np.int64))
        seqs.append(trace.response(i).astype(np.int64))
    if not seqs:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    flat = np.concatenate(seqs).astype(np.uint64)
    rl = trace.response_lengths()[rows]
    seq_len = rl + n_prefix
    seq_start = np.cumsum(seq_len) - seq_len
    # windows ending at each response token: positions seq_start + n_prefix + t
    end = _expand(seq_start + n_prefix, rl)
    h = np.zeros(end.size, np.uint64)
    with np.errstate(over="ignore"):
        for d in range(n_prefix, -1, -1):
            h = h * _H1 + flat[end - d] + np.uint64(1)
        lab = np.repeat(labels.astype(np.uint64), rl)
        h ^= (lab + np.uint64(1)) * _H2
    return h, np.repeat(np.arange(rows.size), rl)


def _reuse(trace: Trace, cur_rows, cur_lab, hist_rows, hist_lab) -> tuple[float, float]:
    ck, crow = _ngram_keys(trace, cur_rows, cur_lab)
    hk, _ = _ngram_keys(trace, hist_rows, hist_lab)
    if ck.size == 0:
        return float("nan"), float("nan")
    hs = np.sort(hk)
    at = np.minimum(np.searchsorted(hs, ck), max(0, hs.size - 1))
    hit = hs[at] == ck if hs.size else np.zeros(ck.size, bool)
    per = np.bincount(crow, weights=hit, minlength=cur_rows.size) / np.maximum(1, np.bincount(crow, minlength=cur_rows.size))
    return float(hit.mean()), float(per.mean())


def _replay_accept(items, k: int, min_prob: float, scopes: int, max_tokens: int, ref_tokens: Optional[int]):
    """Exact-match replay of target responses. ``items``: (prompt, response, group refs,
    history refs [(tokens, weight)]). Returns (accepted draft tokens, steps, tokens)."""
    from verl_ext.spec import DraftIndex

    idx = DraftIndex(32, 0, max(1, k))
    keys, rows, starts, ends = [], [], [], []
    for t, (prompt, resp, refs, hist) in enumerate(items):
        g, h = f"g{t}", f"h{t}"
        for r_i, ref in enumerate(refs):
            ref = ref[:ref_tokens] if ref_tokens else ref
            if len(ref):
                idx.group_append(g, f"r{r_i}", np.ascontiguousarray(ref, np.int32))
        for ref, w in hist:
            ref = ref[:ref_tokens] if ref_tokens else ref
            if len(ref):
                idx.add_history(h, np.ascontiguousarray(ref, np.int32), float(w))
        key = f"t{t}"
        idx.start_request(key, np.ascontiguousarray(prompt, np.int32), group=g, history=h)
        row = np.concatenate([prompt, resp[:max_tokens]]).astype(np.int32)
        keys.append(key)
        rows.append(row)
        starts.append(len(prompt))
        ends.append(len(row))
    if hasattr(idx, "replay"):
        res = idx.replay(keys, rows, starts, ends, k, scopes=scopes, min_prob=min_prob)
        emitted = np.concatenate([np.asarray(e, np.int64) for e, _ in res]) if res else np.zeros(0, np.int64)
        steps, toks = emitted.size, int(emitted.sum())
        return toks - steps, steps, toks
    # fallback: lockstep loop over batch_propose_lists (older native module)
    pos = list(starts)
    live = [i for i in range(len(keys)) if pos[i] < ends[i]]
    acc_total = steps = toks = 0
    while live:
        drafts = idx.batch_propose_lists([keys[i] for i in live], [k] * len(live), scopes=scopes, min_prob=min_prob)
        for i, d in zip(live, drafts):
            row, left = rows[i], ends[i] - pos[i]
            acc = 0
            while acc < len(d) and acc + 1 < left and d[acc] == row[pos[i] + acc]:
                acc += 1
            emit = min(acc + 1, left)
            idx.append(keys[i], row[pos[i]:pos[i] + emit])
            pos[i] += emit
            acc_total += emit - 1
            steps += 1
            toks += emit
        live = [i for i in live if pos[i] < ends[i]]
    return acc_total, steps, toks


def similarity_stats(
    trace: Trace,
    *,
    k: int = 8,
    groups: int = 8,
    targets: int = 2,
    max_tokens: int = 2048,
    ref_tokens: Optional[int] = None,
    reuse_prompts: int = 64,
    min_prob: float = 0.0,
    with_prompt: bool = False,
    seed: int = 0,
) -> dict:
    """Calibration metrics of a (real or synthetic) trace.

    ``reuse_fraction`` (RhymeRL §5.1): over the responses of every epoch ``e >= 1`` of up to
    ``reuse_prompts`` prompts, the fraction of response tokens ``t`` such that the 3 tokens
    before ``t`` (the prompt's last tokens before the response starts) followed by ``t`` occur
    in some epoch ``e-1`` response of the same prompt. This is the token set that the paper's
    routine (3-token prefix, accept the longest identical continuation, else generate one)
    accepts when it takes the longest continuation over all matches. ``reuse_fraction_mean``
    averages per response; ``reuse_other_prompt`` is the same against a *different* prompt's
    previous-epoch responses (chance level of the text).

    ``group`` (Seer Table 2): exact-match replay with the native ``DraftIndex`` (linear drafts
    of up to ``k`` = 8 tokens, the paper's max draft length) of ``targets`` responses in each
    of ``groups`` groups (the last epoch, first ``max_tokens`` tokens). ``accepted_request``:
    draft tokens accepted with the request scope only: the response's own tokens so far, which
    is Seer's n = 0 baseline ("each request's own generation history"); ``with_prompt=True``
    adds the prompt to that context (what the deployed drafter sees; see the note below);
    ``accepted_group``: with the other ``samples-1`` complete responses of the group as
    references (Seer's CST with reference count n = G-1). ``gain = group / request - 1``
    (bonus tokens excluded, as in the paper). ``history``: the same with request + history
    scope (the previous epoch's responses of the prompt, weighted by reward, RhymeRL).

    Note: a synthetic response's chapters after the first are relabelled answers to *other*
    prompts, so the numbers they copy from their own prompts are not in the synthetic prompt.
    Measured with the prompt in context, the request-only baseline of synthetic traces is then
    lower than a real trace's, and the gains higher; the default (no prompt) compares like
    with like.
    """
    from verl_ext.spec import SCOPE_GROUP, SCOPE_HISTORY, SCOPE_REQUEST

    rng = np.random.default_rng(seed)
    by = _groups(trace)
    epochs = trace.epochs()
    out: dict = {"params": {"k": k, "groups": groups, "targets": targets, "max_tokens": max_tokens, "ref_tokens": ref_tokens,
                            "reuse_prompts": reuse_prompts, "min_prob": min_prob, "with_prompt": with_prompt, "seed": seed}}
    # (a) RhymeRL reuse
    uids = sorted({u for (e, u) in by if e == epochs[-1]})
    pick = [uids[i] for i in sorted(rng.choice(len(uids), size=min(reuse_prompts, len(uids)), replace=False))] if uids else []
    cur_rows, cur_lab, hist_rows, hist_lab, oth_rows, oth_lab = [], [], [], [], [], []
    lab = 0
    for e_prev, e in zip(epochs[:-1], epochs[1:]):
        for pi, u in enumerate(pick):
            if (e, u) not in by or (e_prev, u) not in by:
                continue
            other = pick[(pi + 1) % len(pick)]
            c = by[(e, u)]
            cur_rows.append(c)
            cur_lab.append(np.full(c.size, lab))
            hr = by[(e_prev, u)]
            hist_rows.append(hr)
            hist_lab.append(np.full(hr.size, lab))
            if len(pick) > 1 and (e_prev, other) in by:
                orr = by[(e_prev, other)]
                oth_rows.append(orr)
                oth_lab.append(np.full(orr.size, lab))
            lab += 1
    if cur_rows:
        cat = np.concatenate
        out["reuse_fraction"], out["reuse_fraction_mean"] = _reuse(trace, cat(cur_rows), cat(cur_lab), cat(hist_rows), cat(hist_lab))
        out["reuse_other_prompt"] = (_reuse(trace, cat(cur_rows), cat(cur_lab), cat(oth_rows), cat(oth_lab))[0]
                                     if oth_rows else float("nan"))
        out["reuse_responses"] = int(sum(r.size for r in cur_rows))
    else:
        out["reuse_fraction"] = out["reuse_fraction_mean"] = out["reuse_other_prompt"] = float("nan")
        out["reuse_responses"] = 0
    # (b) grouped and history drafting
    e_last = epochs[-1]
    e_prev = epochs[-2] if len(epochs) > 1 else None
    cand = [u for (e, u) in by if e == e_last and by[(e, u)].size > 1]
    cand.sort()
    gpick = [cand[i] for i in sorted(rng.choice(len(cand), size=min(groups, len(cand)), replace=False))] if cand else []
    items_g, items_h = [], []
    for u in gpick:
        rows = by[(e_last, u)]
        hist = []
        if e_prev is not None and (e_prev, u) in by:
            hist = [(trace.response(int(i)), history_weight(float(trace.reward[i]))) for i in by[(e_prev, u)]]
        for t in sorted(rng.choice(rows.size, size=min(targets, rows.size), replace=False).tolist()):
            i = int(rows[t])
            refs = [trace.response(int(r)) for r in rows if int(r) != i]
            prompt = trace.prompt(i) if with_prompt else trace.prompt(i)[-1:]
            items_g.append((prompt, trace.response(i), refs, []))
            items_h.append((prompt, trace.response(i), [], hist))

    def run(items, scopes):
        if not items:
            return {"accepted": 0, "steps": 0, "tokens": 0, "tokens_per_step": float("nan")}
        a, s, t = _replay_accept(items, k, min_prob, scopes, max_tokens, ref_tokens)
        return {"accepted": a, "steps": s, "tokens": t, "tokens_per_step": t / max(1, s)}

    req = run(items_g, SCOPE_REQUEST)
    grp = run(items_g, SCOPE_REQUEST | SCOPE_GROUP)
    out["group"] = {
        "accepted_request": req["accepted"], "accepted_group": grp["accepted"],
        "gain": grp["accepted"] / req["accepted"] - 1 if req["accepted"] else float("nan"),
        "tokens_per_step_request": req["tokens_per_step"], "tokens_per_step_group": grp["tokens_per_step"],
        "targets": len(items_g), "tokens": req["tokens"], "refs_per_target": (int(np.mean([len(x[2]) for x in items_g])) if items_g else 0),
    }
    if e_prev is not None and items_h:
        his = run(items_h, SCOPE_REQUEST | SCOPE_HISTORY)
        out["history"] = {
            "accepted_request": req["accepted"], "accepted_history": his["accepted"],
            "gain": his["accepted"] / req["accepted"] - 1 if req["accepted"] else float("nan"),
            "tokens_per_step_history": his["tokens_per_step"],
        }
    return out


def scope_replay(trace: Trace, spec, epoch: Optional[int] = None) -> dict:
    """Exact-match replay of ``epoch`` (default: the trace's last) with the scopes of ``spec``
    (``SpecOptions``), fed as an engine's drafter is fed: each prompt's responses advance in
    lockstep (group trees grow as they decode); its history holds the earlier epochs' responses
    to it, weighted by reward (``history_weight``); the global tree holds the earlier epochs'
    responses to every prompt, then each finished response of this epoch (groups replay in
    trace order). Returns tokens per step (the mean accepted length, MAL), the acceptance rate
    and the counts behind them."""
    from verl_ext.spec import SCOPE_GLOBAL, SCOPE_HISTORY

    epochs = np.asarray(trace.epoch)
    epoch = int(epochs.max()) if epoch is None else int(epoch)
    rows = np.flatnonzero(epochs == epoch)
    earlier = np.flatnonzero(epochs < epoch)
    mask = spec.mask
    index = spec.new_index(max_bytes=0)
    if mask & SCOPE_HISTORY:
        for i in earlier.tolist():
            index.add_history(str(trace.prompt_uid[i]), trace.response(i).astype(np.int32),
                              history_weight(float(trace.reward[i])))
    if mask & SCOPE_GLOBAL:
        for i in earlier.tolist():
            if len(trace.response(i)):
                index.add_global(trace.response(i).astype(np.int32))
    by_group: dict[str, list[int]] = {}
    for i in rows.tolist():
        by_group.setdefault(str(trace.prompt_uid[i]), []).append(i)
    tokens = steps = drafted = 0
    for g, members in by_group.items():
        keys = [f"{g}\x00{j}" for j in range(len(members))]
        full = [np.concatenate([trace.prompt(i), trace.response(i)]).astype(np.int32) for i in members]
        starts = [len(trace.prompt(i)) for i in members]
        for k, r, st in zip(keys, full, starts):
            index.start_request(k, r[:st], group=g, history=g, scopes=mask)
        try:
            out = index.replay(keys, full, starts, [len(r) for r in full], spec.k, scopes=mask, min_match=spec.min_match,
                               max_match=spec.max_match, min_prob=spec.min_prob, scope_weights=spec.scope_weights)
        finally:
            for k in keys:
                index.finish(k)
            index.drop_group(g)
        for emitted, d in out:
            tokens += int(np.sum(emitted))
            steps += len(emitted)
            drafted += int(np.sum(d))
    accepted = tokens - steps
    return {"scopes": spec.scopes, "epoch": epoch, "responses": len(rows), "tokens_per_step": tokens / max(1, steps),
            "acceptance": accepted / drafted if drafted else 0.0, "tokens": tokens, "steps": steps,
            "draft_tokens": drafted}
