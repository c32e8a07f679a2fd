"""Brute-force reference for the suffix index: the definition in verl_ext/spec/csrc/suffix_tree.h,
computed by enumerating windows."""


class Reference:
    def __init__(self, depth):
        self.depth = depth
        self.seqs = {}  # key -> [tokens, weight, closed]
        self._n = 0

    def append(self, key, toks, weight=1.0):
        self.seqs.setdefault(key, [[], weight, False])[0].extend(toks)

    def close(self, key):
        self.seqs[key][2] = True

    def add_closed(self, toks, weight):
        self.seqs[f"h{self._n}"] = [list(toks), weight, True]
        self._n += 1

    def windows(self):
        d = self.depth
        for toks, w, closed in self.seqs.values():
            starts = range(len(toks)) if closed else range(max(0, len(toks) - d + 1))
            for s in starts:
                yield tuple(toks[s:s + d]), w

    def prio(self, u):
        u = tuple(u)
        return sum(w for win, w in self.windows() if win[: len(u)] == u)

    def exists(self, u):
        u = tuple(u)
        return any(win[: len(u)] == u for win, _ in self.windows())

    def children(self, u):
        u, out = tuple(u), {}
        for win, w in self.windows():
            if len(win) > len(u) and win[: len(u)] == u:
                out[win[len(u)]] = out.get(win[len(u)], 0.0) + w
        return out

    def nodes(self):
        wins = list(self.windows())
        ends = {win for win, _ in wins}
        out = {}
        for win, _ in wins:
            for l in range(1, len(win) + 1):
                u = win[:l]
                if u in out:
                    continue
                if u in ends or len(self.children(u)) >= 2:
                    out[u] = self.prio(u)
        return out

    def _step_options(self, u, cum, min_prob):
        """(set of acceptable next tokens, their probability) or (empty, None) to stop."""
        kids = self.children(u)
        if not kids:
            return set(), None
        total = self.prio(u)
        best = max(kids.values())
        p = min(1.0, best / total) if total > 0 else 0.0
        if p <= 0 or cum * p < min_prob - 1e-6:
            return set(), None
        return {t for t, v in kids.items() if v == best}, p

    def walk_draft(self, ctx, draft, k, min_match, max_match, min_prob):
        """Checks that `draft` is a draft the definition allows; returns match length and probs."""
        d = self.depth
        n = len(ctx)
        hi = min(max_match, n, d - 1)
        lo = max(min_match, 1)
        match_len = 0
        for l in range(hi, lo - 1, -1):
            u = tuple(ctx[n - l:])
            if self.exists(u) and self._step_options(u, 1.0, min_prob)[0]:
                match_len = l
                break
        if match_len == 0:
            return {"ok": not draft, "why": f"expected no draft, got {draft}", "match_len": 0, "probs": []}
        u, cum, probs, i = tuple(ctx[n - match_len:]), 1.0, [], 0
        while True:
            if len(probs) == k:
                break
            if len(u) >= d:  # depth limit: re-match the tail of context + draft
                m = min(hi, d // 2)
                tail = (list(ctx[n - min(n, m):]) + list(draft[:i]))
                m = min(m, len(tail))
                if m < lo or not self.exists(tail[len(tail) - m:]):
                    break
                u = tuple(tail[len(tail) - m:])
                opts, p = self._step_options(u, cum, min_prob)
                if not opts:
                    break
            opts, p = self._step_options(u, cum, min_prob)
            if not opts:
                break
            if i >= len(draft):
                return {"ok": False, "why": f"draft stops early after {i} tokens, could take {opts}"}
            if draft[i] not in opts:
                return {"ok": False, "why": f"token {i} is {draft[i]}, best are {opts}"}
            cum *= p
            probs.append(p)
            u = u + (draft[i],)
            i += 1
        if i != len(draft):
            return {"ok": False, "why": f"draft has {len(draft)} tokens, the definition allows {i}"}
        return {"ok": True, "why": "", "match_len": match_len, "probs": probs}

    def match_len(self, ctx, min_match, max_match, min_prob):
        n, hi = len(ctx), min(max_match, len(ctx), self.depth - 1)
        for l in range(hi, max(min_match, 1) - 1, -1):
            u = tuple(ctx[n - l:])
            if self.exists(u) and self._step_options(u, 1.0, min_prob)[0]:
                return l
        return 0

    def beam_paths(self, ctx, k, min_match, max_match, min_prob, num_paths):
        """Beam search of width `num_paths` over cumulative probability from the longest match:
        each live beam extends by its best `num_paths` children (those keeping cum >= min_prob;
        ties to the smaller token), the beams are re-ranked by (cum, score, tokens) and cut to
        the width. Returns the non-empty paths
        as (tokens, probs, score), best score first; score is the sum of cum over the path."""
        l = self.match_len(ctx, min_match, max_match, min_prob)
        if l == 0 or num_paths <= 0:
            return []
        u0 = tuple(ctx[len(ctx) - l:])
        start = self.prio(u0)
        beams = [(u0, 1.0, [], [], 0.0, False)]
        step = 0
        while step < k and l + step < self.depth:
            nxt, grew = [], False
            for u, cum, toks, probs, score, done in beams:
                if done:
                    nxt.append((u, cum, toks, probs, score, True))
                    continue
                total = self.prio(u)
                kids = sorted(self.children(u).items(), key=lambda kv: (-kv[1], kv[0]))[:num_paths]
                extended = False
                for t, v in kids:
                    p = min(1.0, v / total) if total > 0 else 0.0
                    c = min(1.0, v / start)  # = cum * p, without the rounding of a product
                    if p <= 0 or c < min_prob - 1e-6:
                        break
                    nxt.append((u + (t,), c, toks + [t], probs + [p], score + c, False))
                    extended = grew = True
                if not extended:
                    nxt.append((u, cum, toks, probs, score, True))
            # ties: equal cum (equal prios) go to the score, then to the smaller token sequence
            nxt.sort(key=lambda b: (-round(b[1], 6), -round(b[4], 6), b[2]))
            beams = nxt[:num_paths]
            step += 1
            if not grew:
                break
        out = [(b[2], b[3], b[4]) for b in beams if b[2]]
        return sorted(out, key=lambda x: (-round(x[2], 6), x[0]))
