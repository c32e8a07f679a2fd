#!/usr/bin/env bash
# Main job: installs everything and runs `verl-ext ab` on the default model and workload
# (real local vLLM engines), printing the side-by-side comparison. Arguments go to `verl-ext ab`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/verl-ext ab --out "${VERL_EXT_DEMO_OUT:-runs/demo}" "$@"
