#!/usr/bin/env bash
# Installs everything (scripts/setup_env.sh --test) and runs the test suite. `.ci/run` calls this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hydra`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh --test
exec bash scripts/run_pytest.sh .venv/bin/python tests --durations=25 "$@"
