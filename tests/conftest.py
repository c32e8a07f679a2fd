"""Shared fixtures. `tests/` is deliberately not a package (the verl wheel installs a top-level
`tests` package), so helpers live here and in `_util.py`."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model (SmolLM2-135M-Instruct), converted once per cache dir."""
    from verl_ext.model import default_model_dir

    return default_model_dir()
