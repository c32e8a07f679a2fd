"""SpecActor's greedy Best-of-N assignment (section 4.2, Algorithm 3), as a function.

When workers free up, each freed worker is given the drafting method that has the fewest workers
(lines 1-3); then, method by method, the active requests are taken lowest acceptance rate first and
given a copy on the method's workers while a worker's verification load stays below ``b_max``
(lines 4-10): the lowest-acceptance request is likely the slowest. Workers of a method are all
its workers, freed or not, with verification room. A request never gets a second copy with a method
it already runs with, nor a copy on a worker it already runs on.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def assign_best_of_n(
    rates: Mapping[str, float],
    methods: Sequence[str],
    freed: Sequence[str],
    workers_of: Mapping[str, Sequence[str]],
    load: Mapping[str, int],
    b_max: int,
    running: Mapping[str, set] = None,
) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Algorithm 3.

    ``rates``: active request -> acceptance rate; ``methods``: the candidate drafting methods, in
    preference order (ties of line 2 go to the earlier one); ``freed``: freed workers; ``workers_of``:
    method -> workers already drafting with it; ``load``: worker -> requests it verifies now;
    ``running``: request -> set of ``(method, worker)`` it already runs as (its original and copies).

    Returns ``(method of each freed worker, [(request, method, worker), ...])`` in assignment order.
    """
    if b_max < 1:
        raise ValueError(f"b_max must be >= 1, got {b_max}")
    running = running or {}
    members = {d: list(workers_of.get(d, ())) for d in methods}
    given: dict[str, str] = {}
    for w in freed:  # lines 1-3
        d = min(methods, key=lambda m: (len(members[m]), methods.index(m)))
        members[d].append(w)
        given[w] = d
    loads = {w: int(load.get(w, 0)) for ws in members.values() for w in ws}
    have = {r: set(running.get(r, ())) for r in rates}
    out: list[tuple[str, str, str]] = []
    for d in methods:  # lines 4-10
        order = sorted(rates, key=lambda r: (rates[r], r))  # line 5: lowest acceptance first
        # a request already drafting with d gains nothing from another copy with d
        order = [r for r in order if all(m != d for m, _ in have[r])]
        for w in members[d]:
            while loads[w] < b_max and order:  # lines 7-10
                r = next((x for x in order if all(x_w != w for _, x_w in have[x])), None)
                if r is None:
                    break
                order.remove(r)
                out.append((r, d, w))
                have[r].add((d, w))
                loads[w] += 1
    return given, out
