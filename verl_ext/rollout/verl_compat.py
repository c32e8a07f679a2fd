"""Every use of veRL internals (names veRL does not document as public), in one place, gated on
the veRL versions verl_ext supports. A veRL outside :data:`SUPPORTED_VERL`, or one that lost a
name, fails where verl_ext starts with one error naming what is missing
(:class:`VerlCompatError`), not with an ``AttributeError`` deep inside a rollout.

What verl_ext relies on, in veRL 0.9.x:

* ``LLMServerClient._load_balancer``: the load-balancer actor the manager's client holds;
* ``GlobalRequestLoadBalancer._servers``: its ``server_id -> handle`` registry (no public getter),
  read inside the actor through Ray's public ``__ray_call__`` (:func:`server_handles`);
* ``vLLMHttpServer.engine``: the vLLM engine client inside a rollout server actor
  (:func:`server_engine`; the drafter RPC and aborts run on it);
* the agent-loop worker methods verl_ext's workers wrap (:data:`WORKER_HOOKS_V0`,
  :data:`WORKER_HOOKS_V1`; checked by :func:`require_methods` when the workers are defined);
* ``PPOTrainer._consume_sync_metrics`` (V1), which ``rollout.v1_metrics`` wraps to log
  ``verl_ext/*`` metrics.

The CPU mode's own patches of veRL live in ``verl_ext.cpu.shim``, gated on the same range.
"""

from __future__ import annotations

import functools

from packaging.version import Version

#: veRL versions verl_ext supports: [lo, hi)
SUPPORTED_VERL = (Version("0.9.0"), Version("0.10"))
#: the same, as the hook tables write it (``verl-ext doctor``)
VERL_RANGE = f"veRL >={SUPPORTED_VERL[0]},<{SUPPORTED_VERL[1]}"
#: ``AgentLoopWorker`` (V0) methods ``rollout.workers_v0`` overrides
WORKER_HOOKS_V0 = ("_run_agent_loop", "_agent_loop_postprocess")
#: ``AgentLoopWorkerTQ`` (V1) methods ``rollout.workers_v1`` overrides
WORKER_HOOKS_V1 = ("_run_prompt", "_agent_loop_postprocess")
#: the V1 trainer method whose metrics ``rollout.v1_metrics`` extends
TRAINER_METRICS_HOOK = "_consume_sync_metrics"


class VerlCompatError(RuntimeError):
    """This veRL lacks something verl_ext relies on (or is outside the supported range)."""


def supported(version: str) -> bool:
    lo, hi = SUPPORTED_VERL
    return lo <= Version(Version(version).base_version) < hi


@functools.cache
def verl_version() -> str:
    """The installed veRL's version; raises ``VerlCompatError`` outside ``SUPPORTED_VERL``."""
    import verl

    version = str(getattr(verl, "__version__", "0"))
    if not supported(version):
        lo, hi = SUPPORTED_VERL
        raise VerlCompatError(f"verl_ext supports veRL >={lo},<{hi}; this is veRL {version}")
    return version


def require_methods(cls, names) -> None:
    """Every name in ``names`` is a method of ``cls``, else ``VerlCompatError`` naming it."""
    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise VerlCompatError(f"veRL {verl_version()}: {cls.__name__} has no {', '.join(missing)}, which verl_ext's "
                              f"rollout hooks override; verl_ext supports veRL >={SUPPORTED_VERL[0]},<{SUPPORTED_VERL[1]}")


def _required(obj, name: str, what: str, needs: str):
    """``obj.<name>``, or ``VerlCompatError`` naming ``what`` is missing and what verl_ext ``needs``."""
    value = getattr(obj, name, None)
    if value is None:
        raise VerlCompatError(f"{type(obj).__name__} has no {what} ({name}); {needs}")
    return value


def client_load_balancer(llm_client):
    """The load-balancer actor handle of veRL's ``LLMServerClient``."""
    return _required(llm_client, "_load_balancer", "load balancer handle",
                     f"verl_ext needs veRL's LLMServerClient (veRL {verl_version()})")


def _lb_servers(load_balancer) -> dict:
    """Runs inside veRL's load-balancer actor (``__ray_call__``)."""
    return dict(load_balancer._servers)


def server_handles(load_balancer_handle) -> dict:
    """``server_id -> handle`` of the rollout servers registered with veRL's load balancer."""
    import ray

    verl_version()
    try:
        handles = ray.get(load_balancer_handle.__ray_call__.remote(_lb_servers))
    except Exception as exc:
        raise VerlCompatError(
            "verl_ext could not read the rollout server handles from veRL's load balancer "
            f"({type(exc).__name__}: {exc}); this veRL version is not supported (need 0.9.x)"
        ) from exc
    if not handles:
        raise VerlCompatError("veRL's load balancer has no rollout servers registered")
    return handles


def server_engine(server):
    """The vLLM engine client of a veRL rollout server actor (call inside the actor)."""
    return _required(server, "engine", "vLLM engine client",
                     "verl_ext's drafter RPC and aborts need veRL's vLLMHttpServer")
