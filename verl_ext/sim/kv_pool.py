"""A cluster-wide KV-cache pool for simulated instances (Seer section 5, "global
KVCache pool"; on vLLM, a KV connector such as LMCache or Mooncake: ``kv_transfer_config`` in
the engine arguments, docs/papers/seer.md, "Global KV pool").

Without a pool, a request that comes back to an instance that does not hold its context (a
Seer chunk placed elsewhere, a migrated or re-admitted request) prefills that context again,
at ``token_s`` per token. With one, every request's KV is saved when it leaves an instance's
batch (a chunk ended, an abort, or a recompute preemption: the connector keeps what was
computed), and an instance that admits the request loads the tokens it lacks from the pool
instead of recomputing them, at ``load_token_s`` per token: the KV bytes per token on one GPU
over the pool's link bandwidth. The load is charged in the admitting step, not overlapped with
compute (Seer prefetches into the target instance ahead of time; this is the pessimistic end).
A request that finished for good (EOS) is dropped from the pool, as Seer releases it at once.

The pool holds ``capacity_tokens`` at most (None: unbounded, Seer's DRAM/SSD tiers), least
recently saved first out. Counters: ``saved_tokens``, ``loaded_tokens``, ``evicted_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional

#: default pool link bandwidth per GPU, bytes/s: a 200 Gb/s RDMA NIC (25 GB/s) per GPU, the
#: usual H100/H800 node (8 x 200-400 Gb/s). An assumption; ``verl-ext sim --kv-pool-gbps``.
DEFAULT_POOL_BW = 25e9


def kv_bytes_per_token(derivation: dict) -> float:
    """KV bytes per token on one GPU of a TP group (K and V, every layer): the input of a GPU
    preset's ``derivation`` section (``verl_ext.perf.cost.derive_roofline``)."""
    from verl_ext.perf.cost import kv_bytes_per_gpu

    try:
        d = derivation
        return float(kv_bytes_per_gpu(d["layers"], d["kv_heads"], d["head_dim"], d["dtype_bytes"], max(1, d["tp"])))
    except (KeyError, TypeError):
        raise ValueError("the cost model has no 'derivation' with layers, kv_heads, head_dim, dtype_bytes and tp: "
                         "give the pool's load time per token instead") from None


class KVPool:
    """Contexts' KV held outside the instances, keyed like the prefix cache: (group id, sample
    index) -> context tokens whose KV is saved."""

    def __init__(self, load_token_s: float, capacity_tokens: Optional[int] = None):
        if not load_token_s >= 0 or load_token_s == float("inf"):
            raise ValueError(f"KV pool load time per token must be a finite number >= 0, got {load_token_s!r}")
        if capacity_tokens is not None and capacity_tokens <= 0:
            raise ValueError(f"KV pool capacity must be > 0 tokens (or None), got {capacity_tokens!r}")
        self.load_token_s = float(load_token_s)
        self.capacity_tokens = capacity_tokens
        self._held: OrderedDict[Hashable, int] = OrderedDict()
        self.held_tokens = 0
        self.saved_tokens = 0  # cumulative: tokens newly saved (beyond what the key held)
        self.loaded_tokens = 0  # cumulative: tokens loaded into instances instead of prefilled
        self.evicted_tokens = 0  # cumulative: tokens evicted for room

    def save(self, key: Hashable, tokens: int) -> None:
        """The request ``key`` left an instance holding ``tokens`` context tokens of KV."""
        if tokens <= 0:
            return
        old = self._held.pop(key, 0)
        self._held[key] = max(old, tokens)
        self.saved_tokens += max(0, tokens - old)
        self.held_tokens += self._held[key] - old
        if self.capacity_tokens is not None:
            while self.held_tokens > self.capacity_tokens and self._held:
                _, t = self._held.popitem(last=False)
                self.held_tokens -= t
                self.evicted_tokens += t

    def held(self, key: Hashable) -> int:
        """Context tokens of ``key`` whose KV the pool holds (0: none)."""
        return self._held.get(key, 0)

    def load(self, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens' KV into an instance (counted)."""
        self.loaded_tokens += tokens
        return tokens * self.load_token_s

    def drop(self, key: Hashable) -> None:
        """The request finished for good: its KV is released."""
        self.held_tokens -= self._held.pop(key, 0)

    def stats(self) -> dict:
        return {"kv_pool_saved_tokens": self.saved_tokens, "kv_pool_loaded_tokens": self.loaded_tokens,
                "kv_pool_evicted_tokens": self.evicted_tokens, "kv_pool_load_token_s": self.load_token_s}
