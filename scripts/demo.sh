#!/usr/bin/env bash
# Main job: installs everything and runs `verl-ext ab` on the default model and workload
# (real local vLLM engines), printing the side-by-side comparison. Arguments go to `verl-ext ab`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/verl-ext ab --out "${VERL_EXT_DEMO_OUT:-runs/demo}" "$@"
