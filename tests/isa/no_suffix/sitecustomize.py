"""Makes verl_ext's native extension unimportable, for tests only (tests/test_inert_on_cpu.py).

Put this directory on ``PYTHONPATH`` and every Python process of a run (Ray's workers and vLLM's
engine processes inherit the environment) refuses to import ``verl_ext.spec._suffix``, as on a
machine where the extension was never built or does not load, and appends each attempt, with its
stack, to the file ``$VERL_EXT_TEST_IMPORT_LOG``.
"""

import importlib.abc
import os
import sys
import traceback

BLOCKED = "verl_ext.spec._suffix"


class _Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != BLOCKED:
            return None
        log = os.environ.get("VERL_EXT_TEST_IMPORT_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{name}: pid {os.getpid()} {sys.argv[:3]}\n{''.join(traceback.format_stack())}\n")
        raise ImportError(f"{BLOCKED} made unimportable (tests/isa/no_suffix)")


sys.meta_path.insert(0, _Unimportable())
