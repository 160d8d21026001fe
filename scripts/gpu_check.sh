#!/usr/bin/env bash
# Every GPU check of malleus in one run, for a device machine lent for minutes (docs/cuda.md).
#
#   scripts/gpu_check.sh --prepare      here (no GPU needed): builds the CUDA binaries for any
#                                       x86-64-v3 host and gathers them, with the shared libraries
#                                       they need that a bare machine lacks, into .gpu-carry/
#   scripts/gpu_check.sh [section ...]  on the device machine (with .gpu-carry/ carried along):
#                                       runs the sections (default: all) and prints one summary
#
# Sections: env, kernels (test_cuda_backend), step (the 1.1 B LLaMA step: malleus bf16 against
# PyTorch's, side by side), profile (where malleus's step time goes). Each writes its log to
# $OUT (or .gpu-logs/) and a row of the summary; a failing section does not stop the others, and
# the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry
model=bench/models/llama-1b.json

prepare() {
  set -e
  scripts/setup.sh
  local launcher=()
  if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMALLEUS_BUILD_CUDA=ON \
    -DMALLEUS_NATIVE=OFF -DCMAKE_CXX_FLAGS=-march=x86-64-v3 -DMALLEUS_BUILD_PYTHON=OFF \
    "${launcher[@]}" > build-cuda-configure.log
  local targets=(test_cuda_backend bench_step_throughput)
  cmake --build build-cuda --parallel "$(nproc)" --target "${targets[@]}"
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib"
  for t in tests/test_cuda_backend bench/bench_step_throughput; do
    cp "build-cuda/$t" "$carry/bin/"
    strip "$carry/bin/$(basename "$t")"
  done
  # Shared libraries outside the C runtime and the CUDA driver/toolkit (the device has those).
  ldd "$carry"/bin/* | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
      libcuda.so*|libcublas*|libcudart*|libnvidia*) ;;
      *) cp -L "$lib" "$carry/lib/" ;;
    esac
  done
  du -sh "$carry"
  set +e
}

if [[ "${1:-}" == "--prepare" ]]; then
  prepare
  exit $?
fi

logs=${OUT:-.gpu-logs}
mkdir -p "$logs"
export LD_LIBRARY_PATH="$PWD/$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin=$carry/bin
python=${PYTHON:-python3}
summary=()
failed=0
row() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }
# Runs a section's command with a limit, its output to the log and the screen's tail.
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$logs/$name.log"
  echo "=== $name: exit $rc"
  return $rc
}

section_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tail -n 2
  "$python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1
  command -v mpirun > /dev/null && mpirun --version | head -n 1 || echo "no mpirun on PATH"
  ldd "$bin/test_cuda_backend" | grep -i "not found" || echo "every library found"
  row env "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
}

section_kernels() {
  if run kernels 300 "$bin/test_cuda_backend"; then
    row "kernels (test_cuda_backend)" "passed: $(grep -c '^\[       OK \]' "$logs/kernels.log") cases"
  else
    row "kernels (test_cuda_backend)" "FAILED: $(grep '^\[  FAILED  \]' "$logs/kernels.log" | head -n 3 | tr '\n' ' ')"
    failed=1
  fi
}

section_step() {
  run step-malleus 240 "$bin/bench_step_throughput" "$model" 16 5 --backend cuda --math bf16 \
    --micro 2 --accum 2 || { row "1.1B step, malleus" FAILED; failed=1; }
  run step-torch 240 "$python" bench/torch_step.py "$model" --micro 2 --accum 2 --repeats 5 ||
    { row "1.1B step, torch" FAILED; failed=1; }
  local ms ts
  ms=$(awk '/training step/ {for (i = 1; i <= NF; ++i) if ($i ~ /s\/step/) {gsub(/\(/, "", $(i-1)); print $(i-1)}}' "$logs/step-malleus.log")
  ts=$(sed -n 's/^json: //p' "$logs/step-torch.log" | "$python" -c 'import json, sys; print("%.4f" % json.load(sys.stdin)["step_s"])' 2>/dev/null)
  row "1.1B step, malleus bf16" "$(grep -E 'MFU' "$logs/step-malleus.log" | head -n 1 | sed 's/^ *//') ($ms s)"
  row "1.1B step, torch bf16 autocast" "$(grep -o 'MFU [0-9.]* %' "$logs/step-torch.log") ($ts s)"
  if [[ -n "$ms" && -n "$ts" ]]; then
    row "malleus / torch speed" "$(awk -v m="$ms" -v t="$ts" 'BEGIN {printf "%.2fx", t / m}')"
  fi
}

section_profile() {
  MALLEUS_CUDA_PROFILE=1 run profile 180 "$bin/bench_step_throughput" "$model" 16 2 \
    --backend cuda --math bf16 --micro 2 --accum 2 || { row profile FAILED; failed=1; return; }
  row "profile (largest 3)" "$(grep -A3 'cuda backend profile' "$logs/profile.log" | tail -n 3 | awk '{printf "%s %s%%; ", $1, $NF}')"
}

sections=("$@")
((${#sections[@]})) || sections=(env kernels step profile)
for s in "${sections[@]}"; do
  case "$s" in
    env|kernels|step|profile) "section_$s" ;;
    *) echo "gpu_check: unknown section \"$s\" (env, kernels, step, profile)"; exit 2 ;;
  esac
done
echo
echo "=== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ))"
printf '%s\n' "${summary[@]}"
exit $failed
