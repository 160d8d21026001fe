#!/usr/bin/env bash
# Compiles the CUDA backend's sources (src/backend/cuda/*.cu) and the device room's CUDA branch
# alone, warnings as errors, when a CUDA toolkit is installed; says so and succeeds when none is.
# CI runs it: no GPU is needed to compile, and the full CUDA build (-DMALLEUS_BUILD_CUDA=ON,
# docs/cuda.md) would rebuild everything.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [ ! -x "$nvcc" ]; then
  echo "cuda_compile_check: no nvcc found, skipped"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sources=(src/backend/cuda/*.cu)
for source in "${sources[@]}"; do
  "$nvcc" -std=c++20 -arch=sm_90 -O3 -I src -Xcompiler=-Wall,-Wextra --Werror=all-warnings \
    -c "$source" -o "$out/$(basename "$source").o"
done
# The device room's CUDA branch (what `--backend cuda` calls), as a CUDA build compiles it.
"${CXX:-c++}" -std=c++20 -O1 -Wall -Wextra -Werror -DMALLEUS_HAVE_CUDA=1 -I src \
  -c src/device/device.cpp -o "$out/device.o"
echo "cuda_compile_check: ${sources[*]} and src/device/device.cpp (CUDA branch) compile with" \
  "$("$nvcc" --version | tail -1)"
