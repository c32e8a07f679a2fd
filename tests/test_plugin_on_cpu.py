"""The `verl.plugins` entry point: rewrites only a bare `rollout=X` on veRL's main_ppo, never raises."""

import importlib.metadata
import logging

from verl_ext.plugin import LONG_PREFIX, rewrite_rollout_args, running_module


def test_entry_point_registered():
    eps = importlib.metadata.entry_points(group="verl.plugins")
    assert any(ep.name == "verl_ext" and ep.value == "verl_ext.plugin" for ep in eps)


def test_running_module():
    assert running_module(["python", "-m", "verl.trainer.main_ppo", "a=b"]) == "verl.trainer.main_ppo"
    assert running_module(["python", "-u", "-mverl.trainer.main_ppo"]) == "verl.trainer.main_ppo"
    assert running_module(["python", "-X", "dev", "train.py"]) == "train.py"
    assert running_module(["python", "-c", "import verl"]) is None
    assert running_module(["python"]) is None


def test_rewrite_only_on_main_ppo():
    argv = ["-m", "rollout=baseline", "trainer.n_gpus_per_node=8"]
    assert rewrite_rollout_args(argv, "verl.trainer.main_ppo") == [
        "-m", LONG_PREFIX + "baseline", "trainer.n_gpus_per_node=8"]
    assert rewrite_rollout_args(["x/verl/trainer/main_ppo.py", "rollout=baseline"], "x/verl/trainer/main_ppo.py")[1] == (
        LONG_PREFIX + "baseline")
    # other programs and other arguments are left alone
    assert rewrite_rollout_args(argv, "my_app.main") == argv
    assert rewrite_rollout_args(argv, None) == argv
    for untouched in (["-m", "+rollout=x"], ["-m", "rollout.name=vllm"], ["-m", LONG_PREFIX + "baseline"],
                      ["-m", "actor_rollout_ref.rollout.name=vllm"]):
        assert rewrite_rollout_args(untouched, "verl.trainer.main_ppo") == untouched


def test_config_check_joins_the_overrides_once_and_only_on_main_ppo():
    from verl_ext.config.check import CALLBACK_ARG
    from verl_ext.plugin import with_config_check

    # Hydra takes the overrides as one run of positional arguments: the callback joins that run
    argv = ["-m", "rollout=seer", "a=b", "--cfg", "job"]
    assert with_config_check(argv, "verl.trainer.main_ppo") == ["-m", "rollout=seer", "a=b", CALLBACK_ARG, "--cfg", "job"]
    assert with_config_check(["-m"], "verl.trainer.main_ppo") == ["-m", CALLBACK_ARG]
    assert with_config_check(["-m", CALLBACK_ARG], "verl.trainer.main_ppo") == ["-m", CALLBACK_ARG]
    assert with_config_check(argv, "my_app.main") == argv


def test_unknown_name_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="verl_ext"):
        rewrite_rollout_args(["-m", "rollout=nope"], "verl.trainer.main_ppo")
    assert "unknown rollout strategy 'nope'; available: baseline" in caplog.text
