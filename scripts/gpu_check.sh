#!/usr/bin/env bash
# Every GPU check of malleus in one run, for a device machine lent for minutes (docs/cuda.md).
#
#   scripts/gpu_check.sh --prepare      here (no GPU needed): builds the CUDA binaries for any
#                                       x86-64-v3 host and gathers them, with the shared libraries
#                                       they need that a bare machine lacks, into .gpu-carry/
#   scripts/gpu_check.sh [section ...]  on the device machine (with .gpu-carry/ carried along):
#                                       runs the sections (default: all) and prints one summary
#
# Sections: env, kernels (test_cuda_backend), sanitizer (compute-sanitizer's memcheck on the
# kernel tests), step (the 1.1 B LLaMA step: malleus bf16 against PyTorch's, side by side, in two
# batch shapes), profile (where malleus's step time goes). Each writes its log to .gpu-logs/ and a
# row of the summary; a failing section does not stop the others, and the exit status says whether
# all passed.
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

# Each section's log goes here; on a device machine the whole folder comes back as one archive in
# $OUT (which takes few files).
logs=.gpu-logs
rm -rf "$logs" && mkdir -p "$logs"
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

# One step benchmark: "malleus" or "torch", a label, then the benchmark's arguments. Records the
# step time in steps[label] and a summary row.
declare -A steps
step_row() {
  local engine=$1 label=$2 log="$logs/step-$2.log"
  shift 2
  local s=""
  if [[ $engine == malleus ]]; then
    run "step-$label" 200 "$bin/bench_step_throughput" "$model" 16 5 --backend cuda --math bf16 "$@"
    s=$(sed -n 's/.*(\([0-9.]*\) s\/step.*/\1/p' "$log" | head -n 1)
    row "1.1B step, $label" "$(grep -o 'peak *[0-9.]*%' "$log" | awk '{print "MFU " $2}') ($s s)"
  else
    run "step-$label" 200 "$python" bench/torch_step.py "$model" --repeats 5 "$@"
    s=$(sed -n 's/^json: //p' "$log" | "$python" -c 'import json, sys; print("%.4f" % json.load(sys.stdin)["step_s"])' 2>/dev/null)
    row "1.1B step, $label" "$(grep -o 'MFU [0-9.]* %' "$log") ($s s)"
  fi
  [[ -n "$s" ]] || failed=1
  steps[$label]=$s
}

ratio_row() {
  local a=${steps[$1]:-} b=${steps[$2]:-}
  [[ -n "$a" && -n "$b" ]] && row "$1 / $2 speed" "$(awk -v x="$a" -v y="$b" 'BEGIN {printf "%.2fx", y / x}')"
}

section_step() {
  step_row malleus "malleus-2x2" --micro 2 --accum 2
  export MALLEUS_CUDA_GEMM_TUNING=1
  step_row malleus "malleus-2x2-tuned" --micro 2 --accum 2
  unset MALLEUS_CUDA_GEMM_TUNING
  step_row torch "torch-2x2" --micro 2 --accum 2
  step_row malleus "malleus-4x1" --micro 4 --accum 1
  step_row torch "torch-4x1" --micro 4 --accum 1
  ratio_row malleus-2x2 torch-2x2
  ratio_row malleus-2x2-tuned torch-2x2
  ratio_row malleus-4x1 torch-4x1
}

section_sanitizer() {
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if run sanitizer 240 "$sanitizer" --tool memcheck --error-exitcode 9 "$bin/test_cuda_backend" \
      --gtest_filter='*Attention*:*Bf16*:*Fused*:*Rms*:*Swiglu*:*Elementwise*'; then
    row "compute-sanitizer memcheck" "no error ($(grep -c '^\[       OK \]' "$logs/sanitizer.log") cases)"
  else
    row "compute-sanitizer memcheck" "FAILED: $(grep -m 2 -E 'ERROR SUMMARY|Invalid' "$logs/sanitizer.log" | tr '\n' ' ')"
    failed=1
  fi
}

section_profile() {
  MALLEUS_CUDA_PROFILE=1 run profile 180 "$bin/bench_step_throughput" "$model" 16 2 \
    --backend cuda --math bf16 --micro 2 --accum 2 || { row profile FAILED; failed=1; return; }
  row "profile (largest 3)" "$(grep -A3 'cuda backend profile' "$logs/profile.log" | tail -n 3 | awk '{printf "%s %s%%; ", $1, $NF}')"
}

known=(env kernels sanitizer step profile)
sections=("$@")
((${#sections[@]})) || sections=("${known[@]}")
for s in "${sections[@]}"; do
  if [[ " ${known[*]} " != *" $s "* ]]; then
    echo "gpu_check: unknown section \"$s\" (${known[*]})"
    exit 2
  fi
done
for s in "${sections[@]}"; do "section_$s"; done
echo
echo "=== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ))"
printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
[[ -n "${OUT:-}" ]] && tar czf "$OUT/gpu-logs.tar.gz" -C "$logs" .
exit $failed
