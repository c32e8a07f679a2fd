"""The report of a simulated A/B run: ``report.md`` and its PNGs.

* ``kv_running.png``: KV-cache usage and running requests over time, one line per instance
  (the view of Seer's Figures 3 and 9: long-tail instances stay busy while others idle);
* ``completion_cdf.png``: fraction of requests finished over time;
* ``acceptance.png``: draft acceptance over time, for arms with drafting;
* a table with wall time, throughput, tail time (time spent on the last 10% of requests) and
  its share of the rollout, tokens per step, acceptance, preemptions, and the throughput
  ratio against ``baseline`` and ``oracle``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from verl_ext.compare.plots import plot_completion_cdf  # noqa: E402
from verl_ext.pipe.pool import RequestRecord  # noqa: E402

MAX_LINES = 64  # instances drawn per panel; more are summarised by their mean


def _timeline(inst) -> np.ndarray:
    # columns: t, running, waiting, kv fraction, generated, drafted, accepted
    return np.asarray(inst.timeline, dtype=np.float64).reshape(-1, 7)


def plot_kv_running(results, path: Path) -> None:
    n = len(results)
    fig, axes = plt.subplots(n, 2, figsize=(11, 2.6 * n), sharex=True, squeeze=False)
    for row, r in zip(axes, results):
        tls = [_timeline(i) for i in r.instances]
        for col, (c, label, scale) in enumerate(((3, "KV-cache usage (%)", 100.0), (1, "running requests", 1.0))):
            ax = row[col]
            for tl in tls[:MAX_LINES]:
                if len(tl):
                    ax.step(tl[:, 0], tl[:, c] * scale, where="post", lw=0.6, alpha=0.5)
            ax.set_ylabel(label)
            ax.set_title(f"{r.name}" + (f" ({MAX_LINES} of {len(tls)} instances)" if len(tls) > MAX_LINES else ""))
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def acceptance_series(r, bins: int = 40):
    """(bin centres, acceptance per bin) over all instances, or None without drafting."""
    tls = [tl for tl in (_timeline(i) for i in r.instances) if len(tl)]
    if not tls or not any(tl[-1, 5] for tl in tls):
        return None
    end = max(tl[-1, 0] for tl in tls)
    edges = np.linspace(0, end, bins + 1)
    drafted = np.zeros(bins)
    accepted = np.zeros(bins)
    for tl in tls:
        d = np.interp(edges, tl[:, 0], tl[:, 5])
        a = np.interp(edges, tl[:, 0], tl[:, 6])
        drafted += np.diff(d)
        accepted += np.diff(a)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(drafted > 0, accepted / drafted, np.nan)
    return (edges[:-1] + edges[1:]) / 2, acc


def plot_acceptance(results, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    drawn = False
    for r in results:
        s = acceptance_series(r)
        if s is not None:
            ax.plot(*s, label=r.name)
            drawn = True
    if drawn:
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("draft acceptance")
        ax.set_title("Draft acceptance over time")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _fmt(v, f="{:.2f}"):
    return "–" if v is None else f.format(v)


def write_report(out: Path, summary: dict, results) -> None:
    plot_kv_running(results, out / "kv_running.png")
    plot_completion_cdf({r.name: [RequestRecord(**x) for x in r.records] for r in results}, out / "completion_cdf.png")
    has_acc = plot_acceptance(results, out / "acceptance.png")
    cfg, wl = summary["config"], summary["workload"]
    cm = cfg["cost_model"]
    lines = [
        "# Simulated rollout A/B",
        "",
        f"* **Workload:** {wl['requests']} requests ({wl['prompts']} prompts), {wl['response_tokens']:,} response "
        f"tokens, mean {wl['mean_response']:.0f}, max {wl['max_response']} "
        f"({'trace ' + cfg['trace'] if cfg['trace'] else 'synthetic, similarity level: ' + str(wl['similarity'])}; "
        f"epoch {cfg['epoch']}).",
        f"* **Cluster:** {cfg['instances']} instances of `{cm['name']}` ({cm.get('hardware', '')} {cm.get('model', '')}), "
        f"KV capacity {cm['kv_capacity_tokens']:,} tokens, max_num_seqs {cm['max_num_seqs']}.",
        f"* **Created:** {summary['created']}.",
        "",
        "| strategy | wall s | tok/s | tail s (last 10%) | tail share | p90 latency s | tok/step | acceptance | preemptions | vs baseline | vs oracle |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary["strategies"].items():
        share = m["tail_s"] / m["wall_s"] if m["wall_s"] else None
        lines.append(
            f"| {name} | {_fmt(m['wall_s'], '{:.1f}')} | {_fmt(m['throughput_tok_s'], '{:.0f}')} | "
            f"{_fmt(m['tail_s'], '{:.1f}')} | {_fmt(share, '{:.0%}')} | {_fmt(m['latency_p90_s'], '{:.1f}')} | "
            f"{_fmt(m['tokens_per_step'])} | {_fmt(m.get('draft_acceptance'))} | {m.get('preemptions', 0)} | "
            f"{_fmt(m.get('vs_baseline'), '{:.3f}')} | {_fmt(m.get('vs_oracle'), '{:.3f}')} |"
        )
    lines += [
        "",
        "![KV-cache usage and running requests per instance](kv_running.png)",
        "",
        "![Completion CDF](completion_cdf.png)",
        "",
    ]
    if has_acc:
        lines += ["![Draft acceptance over time](acceptance.png)", ""]
    lines += [
        "Tail time is the wall time minus the time at which 90% of requests had finished. "
        "Throughput ratios compare output tokens per second on the same workload and cluster.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
