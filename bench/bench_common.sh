# shellcheck shell=bash
# The preamble the benchmark scripts (bench/bench_*.sh) share, as small functions. Source it
# from the repository root, after `set -euo pipefail` and the `cd` there:
#   cd "$(dirname "$0")/.."
#   source bench/bench_common.sh
# It defines functions only: nothing runs, and no shell option changes, until a script calls one.

# bench_require_malleus: build/malleus, built with scripts/build.sh unless it is there.
bench_require_malleus() {
  [[ -x build/malleus ]] || scripts/build.sh
}

# bench_build_targets BUILD_DIR TARGET...: configures BUILD_DIR (Ninja) unless it is configured,
# then brings the targets up to date, quietly.
bench_build_targets() {
  local build=$1
  shift
  [[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja > /dev/null ||
    return
  cmake --build "$build" --target "$@" > /dev/null
}

# bench_prepare_data: the training data (data/fortunes), prepared by build/malleus unless it is there.
bench_prepare_data() {
  compgen -G "data/fortunes/train_*.bin" > /dev/null || build/malleus prepare-data
}

# bench_allow_mpirun: OpenMPI run as root (containers) needs explicit consent; with more ranks
# than cores, ranks waiting in MPI must yield the CPU to the ones computing instead of busy-polling.
bench_allow_mpirun() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
}

# bench_ready_to_train: what a benchmark running build/malleus under mpirun needs first: the
# binary, the training data, OpenMPI's variables.
bench_ready_to_train() {
  bench_require_malleus
  bench_prepare_data
  bench_allow_mpirun
}

# bench_output_dir DEFAULT [fresh]: prints the results folder, $BENCH_OUT or else DEFAULT, after
# making it; with "fresh", after emptying it first (results of an earlier run removed).
bench_output_dir() {
  local out=${BENCH_OUT:-$1}
  # Called as out=$(bench_output_dir ...), where `set -e` does not reach: failures return.
  if [[ ${2:-} == fresh ]]; then rm -rf "$out" || return; fi
  mkdir -p "$out" || return
  echo "$out"
}

# bench_write_model FILE NAME HIDDEN LAYERS HEADS FFN MAX_SEQ: a model config for `--model FILE`
# with the byte vocabulary (257) and as many key/value heads as heads (the fields in the order of
# the arguments: hidden_size, num_layers, num_heads, ffn_hidden_size, max_seq_len).
bench_write_model() {
  cat > "$1" << JSON
{"name": "$2", "vocab_size": 257, "hidden_size": $3, "num_layers": $4,
 "num_heads": $5, "num_kv_heads": $5, "ffn_hidden_size": $6, "max_seq_len": $7}
JSON
}

# bench_require_count NAME VALUE [LEAST]: exits (status 2) with a message naming the script's
# argument NAME unless VALUE is a whole number of at least LEAST (1).
bench_require_count() {
  local name=$1 value=$2 least=${3:-1}
  if [[ ! $value =~ ^[0-9]+$ ]] || ((10#$value < least)); then
    echo "$(basename "$0"): $name must be a whole number of at least $least, not \"$value\"" >&2
    exit 2
  fi
}

# bench_load_average: the machine's load averages over 1, 5 and 15 minutes, to quote next to the
# figures (timings on a loaded machine are not the machine's).
bench_load_average() {
  cut -d' ' -f1-3 /proc/loadavg
}
