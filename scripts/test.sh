#!/usr/bin/env bash
# Installs everything (scripts/setup_env.sh --test) and runs the test suite. `.ci/run` calls this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hydra`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh --test
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
.venv/bin/python -m pytest tests "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests (e.g. a -k filter that matches nothing).
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
