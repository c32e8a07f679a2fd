#!/usr/bin/env bash
# Installs everything (scripts/setup_env.sh --test) and runs the test suite. `.ci/run` calls it
# with --compat, which adds the vLLM 0.24.0 suite (scripts/test_vllm_compat.sh).
#
#   bash scripts/test.sh              # the whole suite, in lanes (below)
#   bash scripts/test.sh -k hydra     # extra arguments: one pytest run over tests/ with them
#   bash scripts/test.sh --compat     # the whole suite and the vLLM 0.24.0 suite (CI)
#
# Lanes: the suite keeps one of two cores busy on average (engine starts, Ray and servers wait on
# each other), so it runs as two pytest processes side by side, after the real veRL training
# test, which runs alone first (its training runs and identity check need ~17 GB of a 24 GiB
# machine). Lane A: the conformance suite, the inert-install checks (each a veRL run of its own)
# and, with --compat, the vLLM 0.24.0 suite; lane B: every other test. Lane A's output goes to
# runs/test_lane_a.log and is printed when both lanes are done. The exit status is non-zero if
# any of them failed.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
compat=0
if [ "${1:-}" = "--compat" ]; then
  compat=1
  shift
fi
bash scripts/setup_env.sh --test
pytest_run() { bash scripts/run_pytest.sh .venv/bin/python "$@"; }
if [ $# -gt 0 ]; then
  pytest_run tests "$@"
  [ "$compat" = 1 ] && bash scripts/test_vllm_compat.sh "$@"
  exit 0
fi

mkdir -p runs
FIRST=tests/test_verl_e2e_on_cpu.py
LANE_A=(tests/test_conformance.py tests/test_inert_on_cpu.py)
rm -f runs/compat_setup.rc
if [ "$compat" = 1 ]; then  # its packages (mostly downloads) install while the first test runs
  (bash scripts/test_vllm_compat.sh --setup-only >runs/compat_setup.log 2>&1; echo $? >runs/compat_setup.rc) &
fi
status=0
pytest_run "$FIRST" || status=1

lane_a() {
  local rc=0
  pytest_run "${LANE_A[@]}" -p no:cacheprovider --durations=10 || rc=1
  if [ "$compat" = 1 ]; then
    while [ ! -s runs/compat_setup.rc ]; do sleep 2; done
    if [ "$(cat runs/compat_setup.rc)" = 0 ]; then
      bash scripts/test_vllm_compat.sh || rc=1
    else
      cat runs/compat_setup.log
      rc=1
    fi
  fi
  return "$rc"
}
lane_a >runs/test_lane_a.log 2>&1 &
lane_a_pid=$!
trap 'kill "$lane_a_pid" 2>/dev/null' INT TERM
ignore=()
for f in "$FIRST" "${LANE_A[@]}"; do ignore+=(--ignore="$f"); done
pytest_run tests "${ignore[@]}" --durations=20 || status=1
lane_a_status=0
wait "$lane_a_pid" || lane_a_status=1
echo "=== lane A: ${LANE_A[*]}$([ "$compat" = 1 ] && echo ' + scripts/test_vllm_compat.sh') ==="
cat runs/test_lane_a.log
[ "$lane_a_status" = 0 ] || status=1
exit "$status"
