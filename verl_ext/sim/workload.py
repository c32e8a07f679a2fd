"""The simulated workload: a trace (recorded, or the synthetic default scenario), the epoch
that is rolled out, its requests, and the earlier epochs as history."""

from __future__ import annotations

from typing import Optional

import numpy as np

from verl_ext.engine.instance import GenRequest, SamplingSpec
from verl_ext.pipe.oracle import TRUE_LEN
from verl_ext.sim.defaults import DEFAULT_SYNTH


def load_workload(cfg):
    """The trace to replay: a file, or the synthetic default scenario."""
    from verl_ext.trace.format import read_trace

    if cfg.trace:
        return read_trace(cfg.trace)
    import dataclasses

    from verl_ext.trace.synth import KNOBS, SynthConfig, load_source, synthesize, with_level

    params = {**DEFAULT_SYNTH, **cfg.synth, "seed": cfg.seed}
    knobs = {k: params.pop(k) for k in KNOBS if k in params}  # given content knobs replace the level's
    return synthesize(dataclasses.replace(with_level(SynthConfig(**params), cfg.similarity), **knobs), load_source())


def epoch_spec(spec, history, uses_history: bool):
    """``spec`` for an epoch rolled out with ``history`` (the epoch before, or None): a
    history-driven strategy's first epoch drafts from its other scopes, or not at all where the
    history scope is its only one (``SpecOptions.without``)."""
    from verl_ext.spec import SCOPE_HISTORY

    if spec is not None and history is None and uses_history and spec.mask & SCOPE_HISTORY:
        return spec.without("history")
    return spec


def select_epoch(trace, epoch: Optional[int] = None):
    """(epoch, its rows, history) where history = (trace, rows of the epoch before) or None;
    the default epoch is the last one."""
    epochs = trace.epochs()
    epoch = epochs[-1] if epoch is None else epoch
    if epoch not in epochs:
        raise ValueError(f"epoch {epoch} is not in the trace (epochs: {epochs})")
    earlier = [e for e in epochs if e < epoch]
    history = (trace, np.flatnonzero(trace.epoch == earlier[-1])) if earlier else None
    return epoch, np.flatnonzero(trace.epoch == epoch), history


def build_requests(trace, rows: np.ndarray, max_tokens: int) -> list[GenRequest]:
    """The requests of ``rows``, sampled at the temperature the trace was recorded at (its
    ``meta["temperature"]``; 1.0 where it does not say, as for synthetic traces): strategies that
    treat greedy requests differently (``specactor``'s Best-of-N) see what the engines saw."""
    lengths = trace.response_lengths()
    temperature = float((trace.meta or {}).get("temperature", 1.0))
    out = []
    for i in rows.tolist():
        uid, j = str(trace.prompt_uid[i]), int(trace.sample_index[i])
        out.append(
            GenRequest(
                request_id=f"{uid}-s{j}",
                group_id=uid,
                prompt_ids=trace.prompt(i).tolist(),
                sampling=SamplingSpec(temperature=temperature, max_tokens=max_tokens),
                sample_index=j,
                extra={TRUE_LEN: int(lengths[i])},
            )
        )
    return out


def trace_keyed(trace) -> bool:
    """Whether the simulated engines of ``trace`` sample keyed requests by key: as the engines that
    recorded it did where its meta says (``seeds.keyed``, ``verl-ext trace record
    --keyed-sampling``), else as vLLM with verl_ext's plugin does (synthetic workloads, older
    recordings). It decides what a strategy may do with sampled requests (``specactor``'s
    Best-of-N copies them only when keyed), as ``Instance.keyed_sampling`` does on real engines."""
    seeds = (trace.meta or {}).get("seeds")
    return not (isinstance(seeds, dict) and seeds.get("keyed") is False)


def trace_history(trace, epoch: int):
    """A ``HistoryStore`` holding the trace's rollouts of the epochs before ``epoch``, one training
    step per epoch (step = epoch + 1), with each epoch's growth rates recorded."""
    from verl_ext.history.store import HistoryStore, Trajectory

    store = HistoryStore(keep=1, max_bytes=0x7FFFFFFFFFFFFFFF)
    for e in [e for e in trace.epochs() if e < epoch]:
        idx = np.flatnonzero(trace.epoch == e)
        store.ingest(Trajectory(str(trace.prompt_uid[i]), e + 1, int(trace.sample_index[i]), trace.response(i),
                                float(trace.reward[i])) for i in idx)
        store.close_step(e + 1)
    return store
