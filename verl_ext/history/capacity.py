"""How many history shards an epoch needs (RhymeRL section 5: a prompt's history is its last
rollout, read when the prompt comes back, one epoch later).

An epoch's history is every prompt's responses: ``prompts x samples x tokens x 4`` bytes (the
store keeps int32 tokens), e.g. DAPO-17K x 16 x 8k tokens = 8.9 GB. ``plan_shards`` splits that
over shards of at most ``max_bytes`` each; ``dataset_prompts`` reads the prompt count from the
trainer's local Parquet files (their footers only). Where the epoch does not fit (more shards
than ``MAX_AUTO_SHARDS``, or an unknown dataset), the manager says so once at start-up, and the
dispatcher again when a shard first drops a prompt's history to stay under its cap.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Optional, Union

from verl_ext.history.store import BYTES_PER_TOKEN
#: the most shards ``shards: auto`` starts (each one a Ray actor with its own CPU share)
MAX_AUTO_SHARDS = 16


def epoch_history_bytes(prompts: int, samples: int, tokens: int, keep: int = 1) -> int:
    """Bytes the history holds after an epoch: ``keep`` rollouts of every prompt (plus the one
    being filled, which ``keep`` counts when a prompt comes back) at ``tokens`` per response."""
    return int(prompts) * int(samples) * int(tokens) * BYTES_PER_TOKEN * max(1, int(keep))


def plan_shards(need_bytes: Optional[int], max_bytes: int, most: int = MAX_AUTO_SHARDS) -> tuple[int, bool]:
    """(shards, fits): the fewest shards of ``max_bytes`` that hold ``need_bytes``, at most
    ``most``; ``fits`` is False where even ``most`` cannot (or ``need_bytes`` is unknown: one
    shard)."""
    if need_bytes is None:
        return 1, False
    if max_bytes <= 0:
        return most, False
    want = max(1, math.ceil(need_bytes / max_bytes))
    return min(want, most), want <= most


def dataset_prompts(train_files: Union[str, Iterable[str], None], max_samples: Optional[int] = None) -> Optional[int]:
    """Rows of the trainer's training files where they are local Parquet files (read from their
    footers), capped by ``data.train_max_samples`` (> 0); None where any file cannot be read."""
    if train_files is None:
        return None
    files = [train_files] if isinstance(train_files, str) else list(train_files)
    if not files:
        return None
    import pyarrow.parquet as pq

    rows = 0
    for f in files:
        path = os.path.expanduser(str(f))
        if not path.endswith(".parquet") or not os.path.isfile(path):
            return None
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except Exception:
            return None
    if max_samples is not None and int(max_samples) > 0:
        rows = min(rows, int(max_samples))
    return rows
