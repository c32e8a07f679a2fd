"""``vllm.general_plugins`` entry point for verl_ext (``verl_ext_spec``), and what its hooks call.

vLLM's ``custom_class`` proposer API gives ``propose()`` only the sampled tokens and the token
matrix: no request ids, prompts or ``SamplingParams``. Grouped and history drafting need the
request identity, so the drafter, when an engine starts it, has ``GPUModelRunner.propose_draft_token_ids``
(also used by the CPU runner, a subclass) hand it the runner and the step's ``SchedulerOutput``
just before vLLM calls ``propose()`` (``bind_drafter_step``; ``ensure_installed``).

``register`` (every vLLM process: front end, engine core, workers) installs only what costs
nothing per step (issue 47; ``verl_ext.vllm.hooks.install``): position-keyed sampling's admission
hooks, which activate its step hooks when the first keyed request arrives (``verl_ext.vllm.keyed``),
and two worker methods for ``collective_rpc``: ``verl_ext_drafter`` (``drafter_rpc``) loads
history into the drafter, imports group trees from the grouped draft server
(``verl_ext.spec.dgds``) or reads its statistics (ops: ``SuffixProposer.rpc``), and
``verl_ext_engine_info`` (``engine_info_rpc``) reports what the engine runs
(``verl_ext.vllm.machine.engine_info``: vLLM version, CPU ISA and kernel library, keyed
sampling's state and rule). It imports no native code. It never raises: on an unsupported vLLM
it records why (``reason()``) and the drafter, when selected, fails at start-up with that
message. Set ``VERL_EXT_VLLM_PLUGIN=0`` to skip it.

Every hook, its hook point and the vLLM versions it was checked on: ``verl_ext.vllm.hooks``.
"""

from __future__ import annotations

import logging
import os

from verl_ext.vllm import hooks

logger = logging.getLogger(__name__)

_state = {"reason": "the verl_ext vLLM plugin has not run in this process"}


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
    hooks.install()
    _state["reason"] = "installed"


def installed() -> bool:
    return hooks.plugin_installed()


def reason() -> str:
    """Why the plugin's hooks are not installed in this process ("installed" where they are)."""
    return _state["reason"]


def ensure_installed() -> None:
    """Called by the drafter in the worker process: install now (with the drafter's hooks) or
    explain why not."""
    try:
        install()
        hooks.install_drafter()
    except Exception as exc:
        raise RuntimeError(f"{_state['reason']}; {exc}") from exc


def bind_drafter_step(original, runner, scheduler_output, *args, **kwargs):
    """``GPUModelRunner.propose_draft_token_ids``: the runner's drafter, if it is verl_ext's, gets
    the runner and the step's ``SchedulerOutput`` first (``SuffixProposer.bind_step``)."""
    bind = getattr(getattr(runner, "drafter", None), "bind_step", None)
    if bind is not None:
        bind(runner, scheduler_output)
    return original(runner, scheduler_output, *args, **kwargs)


def engine_info_rpc(wrapper) -> dict:
    """``collective_rpc("verl_ext_engine_info")`` target (``WorkerWrapperBase.verl_ext_engine_info``),
    run in each worker."""
    from verl_ext.vllm.machine import engine_info

    return engine_info(getattr(getattr(wrapper, "worker", None), "model_runner", None),
                       {"installed": installed(), "reason": reason()})


def drafter_rpc(wrapper, op: str, *args):
    """``collective_rpc("verl_ext_drafter", args=(op, ...))`` target (``WorkerWrapperBase.verl_ext_drafter``),
    run in each worker."""
    drafter = getattr(getattr(getattr(wrapper, "worker", None), "model_runner", None), "drafter", None)
    rpc = getattr(drafter, "rpc", None)
    if rpc is None:
        raise RuntimeError("this engine does not run the verl_ext suffix drafter (speculative drafting is off)")
    return rpc(op, *args)
