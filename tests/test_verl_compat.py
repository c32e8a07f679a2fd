"""The one place verl_ext uses veRL internals (``verl_ext.rollout.verl_compat``): the installed
veRL has every name verl_ext relies on, and a veRL without one fails with an error that names it."""

import pytest

pytest.importorskip("verl")

from verl_ext.rollout import verl_compat  # noqa: E402
from verl_ext.rollout.verl_compat import VerlCompatError  # noqa: E402


def test_the_supported_range():
    assert verl_compat.supported("0.9.0") and verl_compat.supported("0.9.1") and verl_compat.supported("0.9.2.dev1")
    assert not verl_compat.supported("0.8.5") and not verl_compat.supported("0.10.0")
    assert verl_compat.supported(verl_compat.verl_version())


def test_the_installed_verl_has_every_name_verl_ext_relies_on():
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    verl_compat.require_methods(AgentLoopWorker, verl_compat.WORKER_HOOKS_V0)
    verl_compat.require_methods(getattr(AgentLoopWorkerTQ, "__ray_actor_class__", AgentLoopWorkerTQ),
                                verl_compat.WORKER_HOOKS_V1)
    verl_compat.require_methods(PPOTrainer, [verl_compat.TRAINER_METRICS_HOOK])


def test_a_missing_name_is_one_clear_error():
    class Worker:
        def _run_agent_loop(self):
            pass

    with pytest.raises(VerlCompatError, match="Worker has no _agent_loop_postprocess, which verl_ext"):
        verl_compat.require_methods(Worker, verl_compat.WORKER_HOOKS_V0)
    with pytest.raises(VerlCompatError, match="has no load balancer handle"):
        verl_compat.client_load_balancer(object())
    with pytest.raises(VerlCompatError, match="has no vLLM engine client"):
        verl_compat.server_engine(object())
