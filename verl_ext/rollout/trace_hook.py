"""Trace recording inside veRL training (``custom.verl_ext.trace``; off by default).

With ``actor_rollout_ref.rollout.custom.verl_ext.trace.dir=/abs/dir`` the verl_ext manager
writes one trace (``verl_ext.trace`` format) per recorded training step to
``<dir>/step_<N>.parquet`` (``N`` = veRL's ``global_steps``; steps with ``N % every == 0``).
Validation rollouts are not recorded. A relative ``dir`` is resolved against the working
directory of the process that runs the manager (veRL's task runner), so prefer absolute paths.
Writing errors are logged and never interrupt training.

What is recorded (``epoch == step == N`` in both flavours; ``instance`` is null):

* **Per request, both flavours** (``StrategyLLMClient`` adds it to the server's
  ``TokenOutput.extra_fields["verl_ext_trace"]``; the hook removes it again before veRL stores
  the trajectory): ``finish_reason`` (``verl_ext.rollout.finish``: ``abort`` when the server
  reports ``aborted``; ``length`` when the request produced ``max_tokens`` tokens, i.e. the
  sampling ``max_tokens`` or the rollout's ``response_length``, and the last is no stop token;
  else ``stop``) and wall-clock submit/finish times
  (``time.time()`` in the agent-loop worker; stored relative to the step's first submit).
  Multi-turn loops (veRL's ``tool_agent_loop`` keeps the first turn's ``extra_fields``) get the
  first turn's values.
* **V0** (``trainer.use_v1=false``; ``VerlExtAgentLoopManagerV0.generate_sequences``): the
  output ``DataProto`` is converted by ``trace_from_dataproto``: ``prompt_ids`` = the prompt
  tokens where ``attention_mask`` is 1, ``response_ids`` = the response tokens where
  ``attention_mask`` is 1 (for multi-turn loops this includes tool-observation tokens), the
  reward = ``rm_scores`` summed over the response when veRL computed it during the rollout
  (streaming reward, veRL's default without a separate reward-model pool), else NaN;
  ``prompt_uid`` = ``non_tensor_batch["uid"]`` (from the output, else from the input batch,
  else ``row-<i>``), ``sample_index`` = the row's rank among the rows of its uid. Without the
  per-request info, ``finish_reason`` is ``length`` when the response fills
  ``response_length`` and ``stop`` otherwise.
* **V1** (default trainer, TransferQueue; ``AgentLoopManagerTQ`` is fire-and-forget, so the
  manager never sees outputs): the agent-loop workers are a subclass of veRL's
  ``AgentLoopWorkerTQ`` (``verl_ext.rollout.workers_v1``) that, after veRL's own post-processing
  (reward computed and stored in TransferQueue), sends one row per ``AgentLoopOutput``
  (``uid``, ``session_id`` as ``sample_index``, unpadded ``prompt_ids``/``response_ids``,
  ``reward_score`` or NaN) to a ``StepTraceCollector`` Ray actor, and reports each prompt
  when all its sessions have settled. The manager registers each batch's uids with the
  collector before dispatching it; the collector writes ``step_<N>.parquet`` once every
  registered prompt of step ``N`` has settled (rewriting it if more prompts are added to the
  step later, e.g. DAPO refills or a resume), and writes a step early (``meta.incomplete`` =
  missing prompt count) when a later step is registered first.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from verl_ext.trace.format import Trace, write_trace

logger = logging.getLogger(__name__)

#: key of the per-request info in ``TokenOutput.extra_fields`` / ``AgentLoopOutput.extra_fields``
TRACE_KEY = "verl_ext_trace"
#: steps whose rows the collector keeps after writing them (for late additions to a step)
KEEP_STEPS = 4


def step_path(directory, step: int) -> Path:
    return Path(directory) / f"step_{int(step)}.parquet"


def request_info(output, sampling_params: dict, default_max_tokens: Optional[int], submit_t: float, finish_t: float,
                 stop_ids: Sequence[int] = ()) -> dict:
    """The per-request info the client attaches to a ``TokenOutput`` (see the module docstring);
    ``stop_ids``: the model's EOS ids (``verl_ext.rollout.finish``)."""
    from verl_ext.rollout.finish import finish_reason

    max_tokens = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens", default_max_tokens))
    reason = finish_reason(getattr(output, "token_ids", ()) or (), getattr(output, "stop_reason", None),
                           sampling_params, max_tokens, stop_ids)
    return {"finish_reason": reason, "submit_t": float(submit_t), "finish_t": float(finish_t)}


def _relative_times(infos: Sequence[Optional[dict]]) -> tuple[np.ndarray, np.ndarray]:
    submit = np.array([_num(i, "submit_t") for i in infos], dtype=np.float64)
    finish = np.array([_num(i, "finish_t") for i in infos], dtype=np.float64)
    if len(submit) and not np.isnan(submit).all():
        t0 = np.nanmin(submit)
        submit, finish = submit - t0, finish - t0
    return submit, finish


def _num(info: Optional[dict], key: str) -> float:
    if not isinstance(info, dict):
        return math.nan
    value = info.get(key)
    return math.nan if value is None else float(value)


def _sample_indices(uids: Sequence[str]) -> np.ndarray:
    seen: dict[str, int] = {}
    out = np.empty(len(uids), dtype=np.int32)
    for i, uid in enumerate(uids):
        out[i] = seen.get(uid, 0)
        seen[uid] = out[i] + 1
    return out


def trace_from_dataproto(output, step: int, prompts=None, meta: Optional[dict] = None) -> Trace:
    """Convert V0's ``generate_sequences`` output ``DataProto`` to a ``Trace`` (see the module
    docstring). ``prompts``: the input ``DataProto`` (same rows), used for ``uid`` when the output
    has none. Reads ``non_tensor_batch["verl_ext_trace"]`` if present (without removing it)."""
    import torch

    batch = output.batch
    prompt_ids, responses = batch["prompts"], batch["responses"]
    n, width = prompt_ids.shape[0], prompt_ids.shape[1]
    if "attention_mask" in batch.keys():
        attn = batch["attention_mask"].bool()
        pmask, rmask = attn[:, :width], attn[:, width:]
    else:  # no padding information: whole prompt, response tokens where response_mask is set
        pmask = torch.ones_like(prompt_ids, dtype=torch.bool)
        rmask = batch["response_mask"].bool()
    p_tokens = prompt_ids[pmask].to(torch.int64).numpy()
    r_tokens = responses[rmask].to(torch.int64).numpy()
    p_len = pmask.sum(dim=1).to(torch.int64).numpy()
    r_len = rmask.sum(dim=1).to(torch.int64).numpy()
    p_off = np.concatenate([[0], np.cumsum(p_len)]).astype(np.int64)
    r_off = np.concatenate([[0], np.cumsum(r_len)]).astype(np.int64)

    if "rm_scores" in batch.keys():
        reward = (batch["rm_scores"].float() * rmask.float()).sum(dim=1).numpy().astype(np.float32)
    else:
        reward = np.full(n, np.nan, dtype=np.float32)

    ntb = output.non_tensor_batch
    uids = ntb.get("uid")
    if uids is None and prompts is not None and len(prompts) == n:
        uids = prompts.non_tensor_batch.get("uid")
    uids = [str(u) for u in uids] if uids is not None else [f"row-{i}" for i in range(n)]

    infos = list(ntb.get(TRACE_KEY, [None] * n))
    inferred = np.where(r_len >= responses.shape[1], "length", "stop")
    finish = [
        info["finish_reason"] if isinstance(info, dict) and info.get("finish_reason") else str(inferred[i])
        for i, info in enumerate(infos)
    ]
    submit, finish_s = _relative_times(infos)
    steps = np.full(n, int(step), dtype=np.int32)
    return Trace(
        epoch=steps,
        step=steps.copy(),
        prompt_uid=uids,
        sample_index=_sample_indices(uids),
        prompt_tokens=p_tokens,
        prompt_offsets=p_off,
        response_tokens=r_tokens,
        response_offsets=r_off,
        reward=reward,
        finish_reason=finish,
        instance=[None] * n,
        submit_s=submit,
        finish_s=finish_s,
        meta=dict(meta or {}),
    )


def base_meta(config, settings, flavour: str) -> dict:
    """Trace metadata for veRL runs."""
    rollout = config.actor_rollout_ref.rollout
    model = config.actor_rollout_ref.model.get("path") if "model" in config.actor_rollout_ref else None
    return {
        "source": "verl",
        "flavour": flavour,
        "model": None if model is None else str(model),
        "tokenizer": None if model is None else str(model),
        "strategy": settings.strategy,
        "strategy_options": dict(settings.options),
        "seeds": {"strategy": settings.seed},
        "n": _int_or_none(rollout.get("n")),
        "response_length": _int_or_none(rollout.get("response_length")),
        "temperature": _float_or_none(rollout.get("temperature")),
        "epoch": "the training step (veRL global_steps)",
        "times": "time.time() deltas in the agent-loop workers, from the step's first submit",
    }


def _int_or_none(v):
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _float_or_none(v):
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def _stamp(meta: dict, step: int, **extra) -> dict:
    return {**meta, "step": int(step), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **extra}


def prepare_dir(directory: str) -> Optional[str]:
    """Create the trace directory; the absolute path, or None (logged) when it cannot be used."""
    try:
        path = Path(directory).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"'{path}' is not writable")
        return str(path)
    except Exception as exc:  # tracing must never stop training
        logger.error("verl_ext: trace recording is off: cannot use trace dir '%s' (%s)", directory, exc)
        return None


class V0Recorder:
    """Records V0 ``generate_sequences`` outputs (called by the V0 manager)."""

    def __init__(self, directory: str, every: int, meta: dict):
        self.directory = directory
        self.every = every
        self.meta = meta
        self.written: list[str] = []

    def record(self, prompts, output) -> Optional[str]:
        """Write ``step_<N>.parquet`` for ``output``; removes the per-request info column from
        ``output`` in every case. Never raises; returns the path written or None."""
        try:
            meta_info = getattr(prompts, "meta_info", None) or {}
            if meta_info.get("validate", False):
                return None
            step = int(meta_info.get("global_steps", -1))
            if step % self.every != 0:
                return None
            trace = trace_from_dataproto(output, step, prompts=prompts, meta=_stamp(self.meta, step))
            path = step_path(self.directory, step)
            write_trace(trace, path)
            self.written.append(str(path))
            return str(path)
        except Exception as exc:
            logger.error("verl_ext: could not record the rollout trace of this step (%s: %s)", type(exc).__name__, exc)
            return None
        finally:
            try:
                output.non_tensor_batch.pop(TRACE_KEY, None)
            except Exception:  # pragma: no cover - not a DataProto
                pass


class StepTraceCollector:
    """Collects V1 rows from the agent-loop workers and writes one file per step.

    Plain class; the manager runs it as a Ray actor (``ray.remote(StepTraceCollector)``). Calls
    from one worker arrive in order, so a prompt's rows arrive before its ``done``."""

    def __init__(self, directory: str, meta: dict, keep_steps: int = KEEP_STEPS):
        self.directory = directory
        self.meta = meta
        self.keep_steps = keep_steps
        self.order: dict[int, dict[str, int]] = {}  # step -> uid -> registration order
        self.pending: dict[int, set[str]] = {}
        self.rows: dict[int, dict[str, list[dict]]] = {}
        self.dirty: set[int] = set()  # steps with rows not yet written
        self.written: list[str] = []

    def expect(self, step: int, uids: Sequence[str]) -> None:
        step = int(step)
        order = self.order.setdefault(step, {})
        pending = self.pending.setdefault(step, set())
        rows = self.rows.setdefault(step, {})
        for uid in uids:
            order.setdefault(uid, len(order))
            pending.add(uid)
            rows.pop(uid, None)  # a re-issued prompt replaces its earlier rows
        # a newer step started: write older steps that still wait for prompts (partial)
        for old in sorted(s for s in self.dirty if s < step):
            self._write(old)
        self._forget(step)

    def add(self, step: int, uid: str, rows: list[dict]) -> None:
        step = int(step)
        self.rows.setdefault(step, {}).setdefault(uid, []).extend(rows)
        self.order.setdefault(step, {}).setdefault(uid, len(self.order[step]))
        self.dirty.add(step)

    def done(self, step: int, uid: str) -> Optional[str]:
        step = int(step)
        pending = self.pending.get(step)
        if pending is None:
            return None
        pending.discard(uid)
        if not pending and step in self.dirty:
            return self._write(step)
        return None

    def flush(self) -> list[str]:
        return [p for p in (self._write(s) for s in sorted(self.dirty)) if p]

    def written_paths(self) -> list[str]:
        return list(self.written)

    def _write(self, step: int) -> Optional[str]:
        try:
            by_uid = self.rows.get(step, {})
            order = self.order.get(step, {})
            rows = [r for uid in sorted(by_uid, key=lambda u: order.get(u, 1 << 30)) for r in
                    sorted(by_uid[uid], key=lambda r: r.get("sample_index", 0))]
            infos = [{"submit_t": r.get("submit_t"), "finish_t": r.get("finish_t")} for r in rows]
            submit, finish = _relative_times(infos)
            clean = []
            for r, s, f in zip(rows, submit, finish):
                r = {k: v for k, v in r.items() if k not in ("submit_t", "finish_t")}
                clean.append({**r, "submit_s": s, "finish_s": f})
            missing = len(self.pending.get(step, ()))
            extra = {"incomplete": missing} if missing else {}
            trace = Trace.from_rows(clean, meta=_stamp(self.meta, step, **extra))
            path = step_path(self.directory, step)
            write_trace(trace, path)
            self.written.append(str(path))
            return str(path)
        except Exception as exc:
            logger.error("verl_ext: could not write the rollout trace of step %s (%s: %s)", step, type(exc).__name__, exc)
            return None
        finally:
            self.dirty.discard(step)

    def _forget(self, newest: int) -> None:
        for step in [s for s in self.rows if s <= newest - self.keep_steps and s not in self.dirty]:
            self.rows.pop(step, None)
            self.order.pop(step, None)
            self.pending.pop(step, None)


def v1_rows(outputs: Sequence[Any], infos: Sequence[Optional[dict]], kwargs: dict, response_length: Optional[int]) -> list[dict]:
    """Rows for one V1 agent-loop session (``AgentLoopOutput`` objects after veRL's postprocess)."""
    step = int(kwargs.get("global_steps", -1))
    rows = []
    for out, info in zip(outputs, infos):
        response = [int(t) for t in out.response_ids]
        if isinstance(info, dict) and info.get("finish_reason"):
            reason = info["finish_reason"]
        else:
            reason = "length" if response_length is not None and len(response) >= response_length else "stop"
        rows.append(
            {
                "epoch": step,
                "step": step,
                "prompt_uid": str(kwargs["uid"]),
                "sample_index": int(kwargs.get("session_id", 0)),
                "prompt_ids": [int(t) for t in out.prompt_ids],
                "response_ids": response,
                "reward": None if out.reward_score is None else float(out.reward_score),
                "finish_reason": reason,
                "instance": None,
                "submit_t": _num(info, "submit_t"),
                "finish_t": _num(info, "finish_t"),
            }
        )
    return rows


def history_items(outputs: Sequence[Any], kwargs: dict) -> list[tuple]:
    """``StrategyDispatcher.ingest`` items for one V1 agent-loop session (after veRL's postprocess):
    ``(prompt key, sample index, response ids, reward or None)``."""
    from verl_ext.rollout.dispatcher import prompt_group_id

    sample = int(kwargs.get("session_id", 0))
    return [
        (prompt_group_id(out.prompt_ids), sample, np.asarray(out.response_ids, dtype=np.int32),
         None if out.reward_score is None else float(out.reward_score))
        for out in outputs
    ]


def now() -> float:
    return time.time()
