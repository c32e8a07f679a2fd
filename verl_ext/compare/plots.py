"""PNG plots of an A/B run: request completion CDF, and running requests over time per instance."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from verl_ext.compare.metrics import request_spans  # noqa: E402
from verl_ext.pipe.pool import RequestRecord  # noqa: E402


def plot_completion_cdf(records: Mapping[str, Sequence[RequestRecord]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, recs in records.items():
        spans = request_spans(recs)
        start = min(s[0] for s in spans.values())
        t = np.sort([s[1] - start for s in spans.values()])
        ax.step(t, np.arange(1, len(t) + 1) / len(t), where="post", label=name)
    ax.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("time since rollout start (s)")
    ax.set_ylabel("fraction of requests finished")
    ax.set_title("Request completion CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_running(timelines: Mapping[str, Mapping[str, Sequence[tuple[float, int]]]], path: Path) -> None:
    """``timelines[strategy][instance] = [(t, running), ...]``."""
    n = max(1, len(timelines))
    fig, axes = plt.subplots(n, 1, figsize=(6.4, 2.6 * n), sharex=True, squeeze=False)
    for ax, (name, per_instance) in zip(axes[:, 0], timelines.items()):
        for inst, points in sorted(per_instance.items()):
            if points:
                t, running = zip(*points)
                ax.step(t, running, where="post", label=inst)
        ax.set_ylabel("running requests")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("time since rollout start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
