#!/usr/bin/env bash
# Installs everything (scripts/setup_env.sh --test) and runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hydra`; `--no-setup` first runs
# the tests in .venv as it is (`.ci/run`, once it has installed, and while another suite uses
# this checkout's native extension).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--no-setup" ]; then
  shift
else
  bash scripts/setup_env.sh --test
fi
exec bash scripts/run_pytest.sh .venv/bin/python tests --durations=25 "$@"
