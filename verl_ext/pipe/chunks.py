"""A request generated in pieces (chunks): Seer's divided rollout (Seer section 4.2) and
RhymeRL's migration (RhymeRL section 6.3) both stop a request after some tokens and resume it,
on the same instance (prefix cache) or another one (re-prefill).

A continuation is the same request with a longer prompt (prompt + tokens so far) and the budget
left; the engine draws each next token from the target model given that prefix, so sampling stays
exact. A seeded request's later chunks get derived seeds (``SamplingSpec.for_chunk``) so that chunks
do not replay one random stream. Tokens, logprobs and step counts are concatenated in order: no
token is dropped, duplicated or reordered at a boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from verl_ext.engine.instance import FINISH_LENGTH, Completion, GenRequest
from verl_ext.spec.options import SEQ_OFFSET_KEY

#: ``GenRequest.extra`` key carrying the chunk index of a continuation
CHUNK_KEY = "chunk"
#: ``GenRequest.extra`` key: the request is generated in one piece, never continued (set by a
#: driver whose engine samples it with a state a continuation cannot carry, e.g. vLLM's
#: presence and frequency penalties, which count only the tokens generated in one piece)
WHOLE_KEY = "whole"


def is_whole(request: GenRequest) -> bool:
    """Whether ``request`` must be generated in one piece (no chunks, copies or migrations)."""
    return bool(request.extra.get(WHOLE_KEY))


class Chunked:
    """The state of one request generated chunk by chunk."""

    __slots__ = ("request", "tokens", "logprobs", "steps", "chunks")

    def __init__(self, request: GenRequest):
        self.request = request
        self.tokens: list = []
        self.logprobs: Optional[list] = None
        self.steps: Optional[int] = 0
        self.chunks = 0

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.request.sampling.max_tokens - len(self.tokens)

    def next_request(self, max_tokens: int) -> GenRequest:
        """The request for the next chunk of at most ``max_tokens`` tokens (all that is left for
        a request generated whole, ``is_whole``)."""
        req = self.request
        if is_whole(req):
            max_tokens = self.remaining
        if self.chunks == 0 and max_tokens == req.sampling.max_tokens:
            return req
        return dataclasses.replace(
            req,
            prompt_ids=list(req.prompt_ids) + list(self.tokens),
            sampling=req.sampling.for_chunk(max_tokens, self.chunks),
            extra={**req.extra, CHUNK_KEY: self.chunks, SEQ_OFFSET_KEY: len(self.tokens)},
        )

    def add(self, c: Completion) -> None:
        """Append a chunk's completion."""
        first = self.chunks == 0
        self.tokens = list(c.token_ids) if first else self.tokens + list(c.token_ids)
        if c.logprobs is not None and (self.logprobs is not None or first):
            self.logprobs = list(c.logprobs) if first else self.logprobs + list(c.logprobs)
        else:
            self.logprobs = None
        self.steps = None if self.steps is None or c.num_steps is None else self.steps + c.num_steps
        self.chunks += 1

    def more(self, max_tokens: int, c: Completion) -> bool:
        """Whether the request goes on after chunk ``c`` (added) of at most ``max_tokens``: only
        when the chunk ended on its own budget and budget is left. A shorter "length" (the model's
        context limit), a stop or an abort ends the request."""
        return c.finish_reason == FINISH_LENGTH and len(c.token_ids) == max_tokens and self.remaining > 0

    def result(self, last: Completion) -> Completion:
        """The whole request's completion, ``last`` being its final chunk's."""
        return Completion(self.request.request_id, self.tokens, last.finish_reason, logprobs=self.logprobs,
                          num_steps=self.steps, extra={**last.extra, "chunks": self.chunks})
