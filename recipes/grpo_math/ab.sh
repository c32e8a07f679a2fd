#!/usr/bin/env bash
# A/B on a real cluster: two strategies back to back, same data, same seeds, then a comparison of
# veRL's logged rollout timings (file logger: $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl).
#
#   A=baseline B=baseline STEPS=20 bash recipes/grpo_math/ab.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
A=${A:-baseline}
B=${B:-baseline}
export VERL_FILE_LOGGER_ROOT=${VERL_FILE_LOGGER_ROOT:-$PWD/runs/grpo_ab}
STRATEGY=$A EXPERIMENT=ab_A_$A bash "$HERE/run_grpo.sh" "$@"
STRATEGY=$B EXPERIMENT=ab_B_$B bash "$HERE/run_grpo.sh" "$@"
python "$HERE/compare_timings.py" \
  "$VERL_FILE_LOGGER_ROOT/verl_ext_grpo/ab_A_$A.jsonl" "$VERL_FILE_LOGGER_ROOT/verl_ext_grpo/ab_B_$B.jsonl"
