"""The drafter replayed over recorded responses (a trace): what it would have drafted and
accepted, with no engine.

* ``replay_observations`` / ``fit_from_trace``: RLHFSpec's acceptance map ``F`` (RLHFSpec
  section 5.2). Each prompt's responses advance in lockstep through a ``DraftIndex``; every step
  drafts a full candidate of ``k`` tokens, each node scored by its cumulative empirical
  probability and accepted iff it and every node before it match the trace (exact-match
  acceptance, the law of the rejection sampler for one-hot drafts). ``AcceptanceModel.fit`` bins
  the (score, accepted) pairs into ``F``'s monotone table (``verl-ext fit acceptance``).
* ``trace_acceptance``: the acceptance rate of a scope set on a trace (SpecActor's ladder).
* ``replay_drafts``: the request-scope drafts of each step (``verl-ext fit trace``).
"""

from __future__ import annotations

import numpy as np

from verl_ext.spec import DraftIndex, SpecOptions
from verl_ext.spec.select import AcceptanceModel, cumulative_scores


def _by_group(trace, rows) -> dict[str, list[int]]:
    """``rows`` of ``trace`` by prompt (GRPO group), in row order."""
    by_group: dict[str, list[int]] = {}
    for i in np.asarray(rows).tolist():
        by_group.setdefault(str(trace.prompt_uid[i]), []).append(i)
    return by_group


def replay_observations(trace, rows, spec: SpecOptions, max_steps: int = 1 << 30):
    """(scores, accepted, depths) of every candidate node drafted while replaying ``rows`` of ``trace``."""
    index = DraftIndex(spec.max_depth, 0, spec.k)
    scores, accepted, depths = [], [], []
    mask = spec.mask
    for g, members in _by_group(trace, rows).items():
        keys = [f"{g}\x00{j}" for j in range(len(members))]
        full = [np.concatenate([trace.prompt(i), trace.response(i)]).astype(np.int32) for i in members]
        pos = np.array([len(trace.prompt(i)) for i in members], dtype=np.int64)
        end = np.array([len(r) for r in full], dtype=np.int64)
        for k, i, r in zip(keys, members, full):
            index.start_request(k, r[: pos[keys.index(k)]], group=g, history="", scopes=mask)
        live = list(range(len(members)))
        steps = 0
        while live and steps < max_steps:
            ks = np.minimum(spec.k, end[live] - pos[live] - 1).clip(0)
            toks, n, probs, _ = index.batch_propose([keys[j] for j in live], ks, scopes=mask, min_match=spec.min_match,
                                                    max_match=spec.max_match, min_prob=0.0)
            sc = cumulative_scores(probs, n)
            nxt = []
            for row, j in enumerate(live):
                m = int(n[row])
                want = full[j][pos[j]: pos[j] + m]
                same = toks[row, :m] == want
                a = m if same.all() else int(np.argmin(same))
                scores.append(sc[row, :m])
                accepted.append(np.arange(m) < a)
                depths.append(np.arange(m))
                step = min(a + 1, int(end[j] - pos[j]))
                index.append(keys[j], full[j][pos[j]: pos[j] + step])
                pos[j] += step
                if pos[j] < end[j]:
                    nxt.append(j)
                else:
                    index.finish(keys[j])
            live = nxt
            steps += 1
        for j in live:
            index.finish(keys[j])
        index.drop_group(g)
    if not scores:
        return np.zeros(0, np.float32), np.zeros(0, bool), np.zeros(0, np.int64)
    return np.concatenate(scores), np.concatenate(accepted), np.concatenate(depths)


def fit_from_trace(trace, rows, spec: SpecOptions) -> tuple[AcceptanceModel, dict]:
    s, a, d = replay_observations(trace, rows, spec)
    if not len(s):
        raise ValueError("the trace gave no draft candidates to fit F on (too short, or nothing to match)")
    model = AcceptanceModel.fit(s, a, d)
    return model, {"nodes": int(len(s)), "accepted": int(a.sum()), "scopes": spec.scopes, "k": spec.k}


def trace_acceptance(trace, rows, spec: SpecOptions) -> dict:
    """Per-token acceptance rate of drafting with ``spec`` on ``rows`` of ``trace`` (SpecActor's
    historical acceptance for the draft ladder): each group is replayed in lockstep through the
    native ``DraftIndex.replay`` with the drafter's options, and ``p = A / (A + R)`` (``A``
    accepted draft tokens, ``R`` drafts cut by a rejection), the maximum-likelihood rate of the
    truncated geometric law the ladder's ``tau`` assumes."""
    index = DraftIndex(spec.max_depth, 0, spec.k)
    mask = spec.mask
    acc = rej = drafted = steps = 0
    for g, members in _by_group(trace, rows).items():
        keys = [f"{g}\x00{j}" for j in range(len(members))]
        full = [np.concatenate([trace.prompt(i), trace.response(i)]).astype(np.int32) for i in members]
        starts = [len(trace.prompt(i)) for i in members]
        for k, r, s in zip(keys, full, starts):
            index.start_request(k, r[:s], group=g, history="", scopes=mask)
        try:
            out = index.replay(keys, full, starts, [len(r) for r in full], spec.k, scopes=mask, min_match=spec.min_match,
                               max_match=spec.max_match, min_prob=spec.min_prob)
        finally:
            for k in keys:
                index.finish(k)
            index.drop_group(g)
        for emitted, d in out:
            a = np.minimum(np.asarray(emitted, np.int64) - 1, d)
            acc += int(a.sum())
            rej += int(((a < d) & (d > 0)).sum())
            drafted += int(np.asarray(d).sum())
            steps += len(d)
    p = acc / (acc + rej) if acc + rej else 0.0
    return {"acceptance": p, "accepted_tokens": acc, "draft_tokens": drafted, "rejections": rej, "steps": steps,
            "scopes": spec.scopes, "k": spec.k}


def replay_drafts(trace, rows, spec: SpecOptions) -> dict[int, np.ndarray]:
    """Per row: tokens drafted at each of its steps when ``spec``'s request-scope drafter runs
    alone over the recorded response (exact for greedy decoding)."""
    idx = DraftIndex(spec.max_depth, spec.max_bytes, spec.k)
    out = {}
    for i in rows:
        prompt, resp = trace.prompt(i), trace.response(i)
        row = np.concatenate([prompt, resp]).astype(np.int32)
        idx.start_request("r", prompt, scopes=spec.mask)
        (_, drafted), = idx.replay(["r"], [row], [len(prompt)], [len(row)], spec.k, scopes=spec.mask,
                                   min_match=spec.min_match, max_match=spec.max_match, min_prob=spec.min_prob)
        idx.finish("r")
        out[i] = drafted
    return out
