"""Inter-step migration's handoff (RhymeRL section 6.3): a strategy defers an outlier
to the next training step, and the driver that runs consecutive steps resumes it there.

The strategy stops the request at a chunk boundary (``verl_ext.pipe.chunks``), hands its
``Chunked`` state to the driver's carrier (``Strategy.set_deferral``) and returns a partial
completion whose finish reason is ``FINISH_DEFERRED``; the step's rollout then ends without the
sample. The driver resumes the state in the next step (the same request with prompt + tokens so
far as its prompt; sampling stays exact) and splices the result (``Chunked.result``). The sample's
GRPO group trains with that next step, so every sample is trained exactly once, one step late.

That changes which step trains on a sample and with which weights, so it is off-policy by
construction: a driver accepts it only where the trainer is (``require_carrier``). The simulator's
``one_step_off`` and ``stream`` pipelines carry deferred samples, and so does the dispatcher under
veRL 0.9's async trainers (``verl_ext.rollout.dispatcher``: the request waits for the next
training step, and its ``generate`` call returns the whole response then); veRL's synchronous and
one-step-off-policy recipe trainers, single rollouts (A/B runs) and the on-policy ``sync``
pipeline refuse it.
"""

from __future__ import annotations

from verl_ext.engine.instance import Completion
from verl_ext.pipe.chunks import Chunked
from verl_ext.pipe.strategy import StrategyConfigError

#: finish reason of a partial completion whose request goes on in the next training step
FINISH_DEFERRED = "deferred"


class _NoCarrier:
    """``set_deferral`` was never called: the driver does not carry deferred samples."""

    def __repr__(self) -> str:
        return "NO_CARRIER"


NO_CARRIER = _NoCarrier()


def deferred_completion(st: Chunked, last: Completion) -> Completion:
    """The partial completion a strategy returns for a request it deferred (``st`` holds every
    chunk so far, ``last`` the latest one's completion)."""
    return Completion(st.request.request_id, list(st.tokens), FINISH_DEFERRED, logprobs=st.logprobs,
                      num_steps=st.steps, extra={**last.extra, "chunks": st.chunks, "deferred": True})


def is_deferred(c: Completion) -> bool:
    return c.finish_reason == FINISH_DEFERRED


async def resume_deferred(st: Chunked, pool) -> Completion:
    """The rest of the deferred request ``st`` on ``pool``'s least-loaded instance (its prompt
    plus its tokens so far, re-prefilled there): the request's whole completion. What every
    carrier runs when the next step starts (the simulator's pipeline, the veRL dispatcher)."""
    req = st.next_request(st.remaining)
    c = await pool.run(pool.least_loaded(req.request_id), req)
    st.add(c)
    return st.result(c)


def require_carrier(strategy, carries: bool, where: str) -> None:
    """Refuse a strategy that defers samples (``Strategy.defers_samples``) in a driver that
    cannot carry them to the next step, with a message saying where it can run."""
    if getattr(strategy, "defers_samples", False) and not carries:
        raise StrategyConfigError(
            f"strategy '{strategy.name}': inter_step=true defers samples to the next training step, which "
            f"{where} cannot do: it changes which step (and which weights) train on a sample, so it needs an "
            f"off-policy pipeline that carries them (`verl-ext sim --pipeline one_step_off|stream`). "
            f"Set inter_step=false here")
