"""The custom-strategy example registers and schedules as documented."""

import importlib.util

from conftest import REPO
from _util import ScriptedInstance, requests as _requests

from verl_ext.pipe import InstancePool, available_strategies, make_strategy


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_custom_strategy_example():
    _load("custom_strategy")
    assert "round_robin" in available_strategies()
    insts = [ScriptedInstance("a"), ScriptedInstance("b"), ScriptedInstance("c")]
    strategy = make_strategy("round_robin", {"start": 1})
    await strategy.rollout(_requests(6), InstancePool(insts))
    assert [i.seen for i in insts] == [["r2", "r5"], ["r0", "r3"], ["r1", "r4"]]
    assert strategy.metrics() == {"dispatched": 6.0}


def test_local_engines_example_imports():
    module = _load("local_engines")
    assert callable(module.main)
