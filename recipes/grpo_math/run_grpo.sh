#!/usr/bin/env bash
# GRPO on GSM8K with veRL 0.9.x, where the rollout strategy is a single override.
#
#   STRATEGY=baseline bash recipes/grpo_math/run_grpo.sh [extra Hydra overrides...]
#
# Needs: a GPU node with veRL 0.9.x, official vLLM and verl_ext installed (`pip install -e .[vllm]`),
# and GSM8K in veRL's parquet format (veRL's examples/data_preprocess/gsm8k.py writes it).
# Configs come from installed packages (pkg://), never from a veRL checkout.
set -euo pipefail
STRATEGY=${STRATEGY:-baseline}
DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
N=${N:-8}
SEED=${SEED:-1}
EXPERIMENT=${EXPERIMENT:-grpo_gsm8k_${STRATEGY}}

python -m verl.trainer.main_ppo \
  rollout="${STRATEGY}" \
  algorithm.adv_estimator=grpo \
  data.train_files="${DATA}/train.parquet" \
  data.val_files="${DATA}/test.parquet" \
  data.train_batch_size=256 \
  data.max_prompt_length=512 \
  data.max_response_length=1024 \
  data.seed="${SEED}" \
  actor_rollout_ref.model.path="${MODEL}" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n="${N}" \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.custom.verl_ext.seed="${SEED}" \
  trainer.logger='["console","file"]' \
  trainer.project_name=verl_ext_grpo \
  trainer.experiment_name="${EXPERIMENT}" \
  trainer.n_gpus_per_node="${GPUS:-8}" \
  trainer.nnodes=1 \
  trainer.total_training_steps="${STEPS:-20}" \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  "$@"
