"""Synthetic drafting in the simulator: draft-model methods, whose drafts a trace cannot replay.

SpecActor (sections 4.2 and 5) ranks drafting methods that include small draft models
(e.g. Qwen2.5-0.5B and 1.5B for a 32B target). A trace holds the target's tokens, not what a draft
model would have proposed, so the replay drafter (``verl_ext.sim.drafting``) cannot draft for them.
``SyntheticDrafter`` stands in with the model SpecActor's own analysis uses (section 4.1, the TGS
model; its Figure 6 marks drafts accepted at a given rate):

* every (request, method) pair has its own per-token acceptance rate ``p``, drawn once from a
  Beta distribution with the method's mean ``acceptance`` and ``concentration`` (larger: less
  spread between requests), seeded by (seed, request id, method), so a Best-of-N copy of a request
  with another method meets that method's rate for it, the same in every arm;
* a step that drafts ``w`` tokens for the request accepts a prefix of ``a`` tokens with
  ``P(a = i) = p^i (1 - p)`` for ``i < w`` and ``p^w`` for ``a = w``, and emits ``a + 1`` tokens
  (the target's own token), never past the response's end; draws come from a per-request stream,
  so an arm's outcome does not depend on how the batch was composed;
* a model method costs its draft model's time: ``w`` autoregressive draft steps of the drafting
  requests, from the draft model's ``CostModel``; a model-free method costs nothing here.
  **Coupled** (the default; vanilla speculative decoding): the draft model runs on the
  instance's GPUs before each verification, so a step takes draft + verify time.
  **Decoupled** (``decoupled=True``; SpecActor section 4.1): the draft model runs on its own GPU
  (the caller gives it one: fewer instances for the same GPUs) at most ``w`` tokens ahead, so a
  round takes ``max(w D(b), V_w(b))``; a rejection wastes the window drafted ahead from the
  rejected prefix, so the request's next round verifies stale drafts and emits only the
  target's own token (the relaxed barrier's ``2w - 1`` wasted tokens at most).
  **Per request** (SpecActor Algorithm 2, ``set_mode``): in decoupled execution a request can be
  switched to coupled speculation; its drafts then run on the instance before the verification
  (``max(V + D_coupled, D_decoupled)`` for a mixed step) and waste no window.

The tokens emitted are the trace's, whatever the rates: outputs are the target's. The method of a
request is ``GenRequest.extra["spec_method"]`` (default: ``default``); its window is the
instance's draft cap (``spec_window``). Independence between methods and between requests is an
assumption of this model, not a measurement: it is what lets a second method help a request the
first one drafts badly for.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from verl_ext.engine.instance import GenRequest
from verl_ext.sim.source import Target
from verl_ext.spec.options import SpecOptions


@dataclass(frozen=True)
class SyntheticMethod:
    """One drafting method: mean per-token ``acceptance``, Beta ``concentration`` of the per-request
    rates, and the draft model's ``CostModel`` (None: model-free, free to run)."""

    acceptance: float
    concentration: float = 8.0
    draft_cost: Optional[object] = None

    def __post_init__(self):
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")
        if self.concentration <= 0:
            raise ValueError(f"concentration must be > 0, got {self.concentration}")


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


class SyntheticDrafter:
    """A per-step drafter for ``SimInstance`` with synthetic per-request acceptance (module
    docstring). ``spec``: ``k`` is the most draft tokens per step (the windows cap it)."""

    per_step = True
    lazy_history = False
    mode = "synthetic"

    def __init__(self, spec: SpecOptions, methods: Mapping[str, SyntheticMethod], default: str, seed: int = 0,
                 decoupled: bool = False):
        if default not in methods:
            raise ValueError(f"default method {default!r} is not among {sorted(methods)}")
        self.spec = spec
        self.methods = dict(methods)
        self.default = default
        self.seed = int(seed)
        self.decoupled = bool(decoupled)
        self._coupled: set = set()  # decoupled execution: keys switched to coupled (Algorithm 2)
        self._req: dict[str, tuple] = {}  # key -> (method, p, end position, rng)
        self._stale: dict[str, int] = {}  # decoupled: key -> position whose round verifies a stale window
        self.stale_rounds = 0

    # -- the drafter interface of SimInstance (per_step) --------------------------------------
    def started(self, key: str) -> bool:
        return key in self._req

    def rate(self, request_id: str, method: str) -> float:
        """The per-token acceptance of ``request_id`` drafted by ``method``."""
        m = self.methods[method]
        if m.acceptance in (0.0, 1.0):
            return m.acceptance
        rng = np.random.default_rng(_seed(self.seed, request_id, method))
        return float(rng.beta(m.acceptance * m.concentration, (1.0 - m.acceptance) * m.concentration))

    def start(self, key: str, request: GenRequest, target: Target) -> None:
        method = str(request.extra.get("spec_method") or self.default)
        if method not in self.methods:
            method = self.default
        p = self.rate(request.request_id, method)
        rng = np.random.default_rng(_seed(self.seed, request.request_id, method, target.prompt_len))
        self._req[key] = (method, p, target.prompt_len + len(target.tokens), rng)

    def set_mode(self, key: str, decoupled: bool) -> None:
        """Algorithm 2's execution mode of one request. Decoupled needs decoupled execution (the
        instance's drafter GPU); in coupled execution every request is coupled already."""
        if not self.decoupled:
            if decoupled:
                raise ValueError("a request runs decoupled only in decoupled execution (a drafter GPU per verifier)")
            return
        if decoupled:
            self._coupled.discard(key)
        else:
            self._coupled.add(key)
            self._stale.pop(key, None)  # nothing drafted ahead any more

    def is_decoupled(self, key: str) -> bool:
        return self.decoupled and key not in self._coupled

    def step(self, keys, positions, caps=None, selector=None, kv_tokens: float = 0.0):
        b = len(keys)
        ks = np.full(b, self.spec.k, dtype=np.int64) if caps is None else np.minimum(np.asarray(caps, np.int64), self.spec.k)
        emitted = np.ones(b, dtype=np.int64)
        drafted = np.zeros(b, dtype=np.int64)
        for j, (key, pos) in enumerate(zip(keys, np.asarray(positions).tolist())):
            _, p, end, rng = self._req[key]
            left = end - pos
            w = int(min(ks[j], max(0, left - 1)))
            if w <= 0:
                continue
            decoupled = self.is_decoupled(key)
            if decoupled and self._stale.get(key) == pos:  # this round verifies a stale window
                drafted[j] = w
                self.stale_rounds += 1
                continue
            # accepted prefix: the first rejection among w Bernoulli(p) trials
            if p >= 1.0:
                a = w
            elif p <= 0.0:
                a = 0
            else:
                a = min(int(rng.geometric(1.0 - p)) - 1, w)
            emitted[j] = min(a + 1, left)
            drafted[j] = w
            if decoupled and a < w:
                self._stale[key] = pos + int(emitted[j])
        return emitted, drafted

    def with_drafting(self, verify_s: float, keys, drafted: np.ndarray, kv_tokens: float) -> float:
        """A step's time with its draft models: coupled, draft then verify; decoupled, the slower
        of the two pipelined stages; a mixed step (Algorithm 2 switched some requests to coupled),
        the coupled requests' drafts then the verification, beside the decoupled drafts."""
        if not self.decoupled:
            return verify_s + self.draft_seconds(keys, drafted, kv_tokens)
        coupled = np.fromiter((k in self._coupled for k in keys), dtype=bool, count=len(keys))
        if not coupled.any():
            return max(verify_s, self.draft_seconds(keys, drafted, kv_tokens))
        drafted = np.asarray(drafted)
        before = self.draft_seconds(keys, np.where(coupled, drafted, 0), kv_tokens)
        beside = self.draft_seconds(keys, np.where(coupled, 0, drafted), kv_tokens)
        return max(verify_s + before, beside)

    def draft_seconds(self, keys, drafted: np.ndarray, kv_tokens: float) -> float:
        """Time the step's draft models take on the instance: per model method, ``max w`` draft
        steps of its drafting requests (coupled: before the verification)."""
        by: dict[str, list] = {}
        for key, d in zip(keys, np.asarray(drafted).tolist()):
            if d > 0:
                by.setdefault(self._req[key][0], []).append(d)
        total = 0.0
        ctx = kv_tokens / max(1, len(keys))
        for name, ws in by.items():
            cost = self.methods[name].draft_cost
            if cost is None:
                continue
            total += max(ws) * float(cost.step_time(len(ws), len(ws) * ctx))
        return total

    def finish(self, key: str, pos: int) -> None:
        self._req.pop(key, None)
        self._stale.pop(key, None)
        self._coupled.discard(key)

    def drop(self, key: str) -> None:
        self.finish(key, 0)

    def response_done(self, request, target, emitted) -> bool:
        return False

    def attach(self, instance) -> None:
        pass

    def finished_fraction(self, groups) -> np.ndarray:
        return np.zeros(len(groups))
