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
# batch shapes), profile (where malleus's step time goes), train (train, eval and generate with
# --backend cuda), plans (2 ranks on the GPU against 1 rank), torch (malleus.torch on the GPU:
# python/tests/gpu_torch_check.py). Each writes its log to .gpu-logs/ and a row of the summary; a
# failing section does not stop the others, and the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry
model=bench/models/llama-1b.json

prepare() {
  set -e
  scripts/setup.sh
  local launcher=()
  if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  # The Python module is built too (for this machine's python3): its position-independent static
  # libraries are what the device links its own module from (python_module below).
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMALLEUS_BUILD_CUDA=ON \
    -DMALLEUS_NATIVE=OFF -DCMAKE_CXX_FLAGS=-march=x86-64-v3 -DMALLEUS_BUILD_PYTHON=ON "${launcher[@]}" \
    > build-cuda-configure.log
  cmake --build build-cuda --parallel "$(nproc)" \
    --target test_cuda_backend bench_step_throughput malleus malleus_python
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/lib" "$carry/static" "$carry/include"
  for t in tests/test_cuda_backend bench/bench_step_throughput malleus; do
    cp "build-cuda/$t" "$carry/bin/"
    strip "$carry/bin/$(basename "$t")"
  done
  cp build-cuda/src/*/libmalleus_*.a "$carry/static/"
  cp -r /usr/include/nlohmann "$carry/include/"
  cp -r "$(mpicc --showme:incdirs | awk '{print $1}')" "$carry/include/openmpi"
  # Shared libraries outside the C runtime, the CUDA driver and toolkit and Open MPI (the device
  # has those: its own libmpi.so.40 serves our binaries).
  ldd "$carry"/bin/* | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++*|libgcc_s*) ;;
      libcuda.so*|libcublas*|libcudart*|libnvidia*) ;;
      libmpi*|libopen-rte*|libopen-pal*|libhwloc*|libevent*|libudev*) ;;
      *) cp -L "$lib" "$carry/lib/" ;;
    esac
  done
  # The demo's data, prepared here (the device has no fortunes corpus).
  mkdir -p "$carry/data"
  build-cuda/malleus prepare-data --output "$carry/data/fortunes" > /dev/null
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
# Our libraries, then Open MPI's where the device keeps them outside the linker's cache.
ompi_lib=$(ompi_info --path libdir 2> /dev/null | awk '{print $NF}')
export LD_LIBRARY_PATH="$PWD/$carry/lib${ompi_lib:+:$ompi_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
  ldd "$bin"/* | grep -i "not found" || echo "every library found"
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

# ---- the malleus command on the GPU ----------------------------------------------------------
data=$carry/data/fortunes
mpi=(mpirun --oversubscribe -np 2)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # the device runs commands as root
# The demo on short sequences: small enough that 2 ranks on one GPU take seconds.
demo=(train --backend cuda --train-data "$data/train_*.bin" --seq-len 128 --global-batch 16
      --micro-batch 2 --warmup-steps 2 --checkpoint-every 0 --no-memory-checkpoints
      --no-async-checkpoints)

# Losses of two runs' metrics: the largest relative difference, and whether the plan changed.
# compare_losses ONE OTHER TOLERANCE [replan]: with "replan", OTHER must have switched plans.
compare_losses() {
  "$python" - "$@" << 'PY'
import json, sys
def steps(path):
    rows = [json.loads(l) for l in open(path)]
    return {r["step"]: r for r in rows if "loss" in r}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
common = sorted(set(a) & set(b))
worst = max(abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in common)
plans = sorted({b[s]["plan"] for s in common})
print(f"{len(common)} steps, largest loss difference {worst:.2e}, plans: {' -> '.join(plans)}")
replanned = len(plans) > 1 or len(sys.argv) < 5
if not replanned:
    print("no re-plan: the straggler was not planned around")
sys.exit(0 if len(common) == len(a) and worst <= float(sys.argv[3]) and replanned else 1)
PY
}

section_train() {
  rm -rf runs/gpu-*
  if run train-demo 120 "$bin/malleus" "${demo[@]}" --steps 30 --eval-every 30 \
      --val-data "$data/val_*.bin" --out runs/gpu-demo; then
    row "train --backend cuda, demo" "$(grep -E '^step +30/30' "$logs/train-demo.log" | cut -d'|' -f2,5 | tr -s ' ')"
  else
    row "train --backend cuda, demo" FAILED; failed=1
  fi
  run eval-demo 60 "$bin/malleus" eval --backend cuda --checkpoint runs/gpu-demo \
    --data "$data/val_*.bin" --samples 64 && row "eval --backend cuda" "$(tail -n 1 "$logs/eval-demo.log")" ||
    { row "eval --backend cuda" FAILED; failed=1; }
  run generate-demo 60 "$bin/malleus" generate --backend cuda --checkpoint runs/gpu-demo \
    --max-tokens 64 --seed 1 && row "generate --backend cuda" "$(wc -c < "$logs/generate-demo.log") bytes of text" ||
    { row "generate --backend cuda" FAILED; failed=1; }
  # The 1.1 B model: a few steps at sequence 2048, its last checkpoint in memory.
  if run train-1b 240 "$bin/malleus" train --backend cuda --model "$model" --seq-len 2048 \
      --micro-batch 2 --global-batch 4 --steps 4 --warmup-steps 1 --eval-every 0 \
      --checkpoint-every 0 --no-memory-checkpoints --train-data "$data/train_*.bin" \
      --val-data "" --out /dev/shm/gpu-1b; then
    row "train --backend cuda, 1.1 B" "$(grep -E '^step +4/4' "$logs/train-1b.log" | cut -d'|' -f2,5 | tr -s ' ')"
  else
    row "train --backend cuda, 1.1 B" FAILED; failed=1
  fi
  rm -rf /dev/shm/gpu-1b
}

# 2 ranks sharing the one GPU: a data-parallel plan, a 2-stage pipeline and a re-plan under an
# injected straggler, each against 1 rank's losses (bf16 storage: relative 2e-3; the re-plan must
# happen), and data parallel in exact math (fp32 products: relative 1e-4). The dp2 row also says
# how device buffers met MPI (the log's "communication:" line: staged or CUDA-aware).
section_plans() {
  local short=(--steps 12 --eval-every 0 --val-data "")
  local exact=(--cuda-math exact)
  run plans-1 120 "$bin/malleus" "${demo[@]}" "${short[@]}" --no-replan --out runs/gpu-1 &&
    run plans-1-exact 120 "$bin/malleus" "${demo[@]}" "${short[@]}" "${exact[@]}" --no-replan \
      --out runs/gpu-1-exact || { row "plans" FAILED; failed=1; return; }
  local name args one tolerance must
  for name in dp2 pp2 replan dp2-exact; do
    one=runs/gpu-1 tolerance=2e-3 must=()
    case $name in
      dp2) args=(--dp 2 --no-replan) ;;
      pp2) args=(--dp 1 --pp 2 --no-replan) ;;
      replan) args=(--dp 2 --straggler 1:4:3-12 --monitor-window 2 --replan-horizon 5)
              must=(replan) ;;
      dp2-exact) args=(--dp 2 --no-replan "${exact[@]}") one=runs/gpu-1-exact tolerance=1e-4 ;;
    esac
    if run "plans-$name" 180 "${mpi[@]}" "$bin/malleus" "${demo[@]}" "${short[@]}" "${args[@]}" \
        --out "runs/gpu-$name" &&
        compare_losses "$one/metrics.jsonl" "runs/gpu-$name/metrics.jsonl" "$tolerance" \
          "${must[@]}" > "$logs/compare-$name.log"; then
      row "2 ranks on 1 GPU, $name" "$(cat "$logs/compare-$name.log")"
    else
      row "2 ranks on 1 GPU, $name" "FAILED: $(cat "$logs/compare-$name.log" 2>/dev/null)"; failed=1
    fi
  done
  row "2 ranks on 1 GPU, MPI" "$(grep -h -m 1 '^communication:' "$logs/plans-dp2.log" | cut -c 16-)"
  grep -h -m 3 -i "re-plan\|switch" "$logs/plans-replan.log" | head -n 3
}

# The device's python3 with our module: compiled there (its Python and pybind11) from the carried
# position-independent static libraries, into .gpu-python/ beside the package's Python files.
python_module() {
  [[ -f .gpu-python/malleus/built ]] && return 0
  local suffix includes libdir mpi
  suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  # Open MPI's headers: the device's own where it has them, else the ones carried from here (the
  # same 4.1 ABI).
  includes="$("$python" -m pybind11 --includes) -I$(ompi_info --path incdir 2> /dev/null | awk '{print $NF}') -I$carry/include/openmpi"
  libdir=$(ompi_info --path libdir 2> /dev/null | awk '{print $NF}')
  mpi=$(ls "$libdir"/libmpi.so.40 2> /dev/null || ldconfig -p | awk '/libmpi.so.40 /{print $NF; exit}')
  rm -rf .gpu-python && mkdir -p .gpu-python && cp -r python/malleus .gpu-python/
  # Without the MPI-2 C++ bindings, as the build here (src/comm/CMakeLists.txt): their symbols are
  # in libmpi_cxx, which the module does not link.
  g++ -O2 -std=c++20 -shared -fPIC -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1 $includes -I src \
    -I "$carry/include" python/src/*.cpp \
    -o ".gpu-python/malleus/_malleus$suffix" \
    -Wl,--start-group "$carry"/static/libmalleus_*.a -Wl,--end-group "$mpi" \
    "$carry/lib/libopenblas.so.0" "$carry/lib/libgomp.so.1" "$carry/lib/libxxhash.so.0" -lpthread \
    -Wl,-rpath,"$PWD/$carry/lib" && touch .gpu-python/malleus/built
}

# malleus.torch on the GPU: a world of one over NCCL and 2 processes sharing the GPU over gloo,
# each against one process (python/tests/gpu_torch_check.py), with the module built here.
section_torch() {
  if ! python_module > "$logs/torch-module.log" 2>&1; then
    row "malleus.torch on the GPU" "FAILED: the module did not build (torch-module.log)"
    failed=1
    return
  fi
  if PYTHONPATH=$PWD/.gpu-python run torch 240 "$python" python/tests/gpu_torch_check.py; then
    row "malleus.torch on the GPU" "$(tail -n 1 "$logs/torch.log")"
  else
    row "malleus.torch on the GPU" "FAILED: $(grep -m 2 '^FAIL' "$logs/torch.log" | cut -c 1-80 | tr '\n' ' ')"
    failed=1
  fi
}

section_profile() {
  MALLEUS_CUDA_PROFILE=1 run profile 180 "$bin/bench_step_throughput" "$model" 16 2 \
    --backend cuda --math bf16 --micro 2 --accum 2 || { row profile FAILED; failed=1; return; }
  row "profile (largest 3)" "$(grep -A3 'cuda backend profile' "$logs/profile.log" | tail -n 3 | awk '{printf "%s %s%%; ", $1, $NF}')"
}

known=(env kernels sanitizer step profile train plans torch)
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
