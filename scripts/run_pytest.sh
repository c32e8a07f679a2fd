#!/usr/bin/env bash
# `run_pytest.sh PYTHON ARGS...`: PYTHON -m pytest ARGS with the test environment's settings
# (one OpenMP thread, no model hub), exit status 0 when pytest collected no tests (its status 5,
# e.g. a -k filter that matches nothing). Used by scripts/test.sh and scripts/test_vllm_compat.sh.
set -uo pipefail
# exported even when the shell started without one (env -i): vLLM's sampler compiles C++ with
# torch inductor, whose g++ must find its own tools on PATH
export PATH
# each vLLM engine, Ray worker and veRL process imports torch and veRL: without cached bytecode
# that took 2.3x as long (torch + verl: 20 s against 9 s on a 2-core AMD EPYC), so let Python
# write .pyc files even where the shell says not to (as scripts/test.sh does)
unset PYTHONDONTWRITEBYTECODE
python=$1
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# a crash in the test process, also after pytest's own fault handler is off (at exit), prints
# every thread's Python stack
export PYTHONFAULTHANDLER=1
"$python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 0
fi
exit "$rc"
