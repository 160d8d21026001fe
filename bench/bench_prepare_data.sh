#!/usr/bin/env bash
# SentencePiece tokenization throughput of `malleus prepare-data` against Debian's spm_encode
# (package sentencepiece) on the same corpus and model, and whether their token ids agree.
#
#   flock /work/.cpu.lock bench/record.sh prepare_data bench/bench_prepare_data.sh [RUNS] [REPEAT]
#
# Corpus: Debian's fortunes, one fortune per line (its line breaks as spaces), REPEAT times over
# (default 4, about 10 MB); model: an 8000-token BPE model trained on it by
# `malleus train-tokenizer` (LLaMA-2's settings). spm_encode reads the lines as text and writes
# ids (with bos and eos, as prepare-data puts them); prepare-data reads the same lines as JSON
# Lines (plain, and zstd-compressed) and writes shards. Each configuration runs RUNS times
# (default 5), interleaved; the medians of wall and CPU time (user + system) are printed, with the
# ratio to spm_encode. The ids of every prepare-data run are checked against spm_encode's: the
# script fails if one differs. bench/record.sh prepare_data bench/bench_prepare_data.sh appends the
# run to bench/results/prepare_data.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/bench_common.sh
bench_require_malleus
command -v spm_encode > /dev/null || { echo "spm_encode missing: run scripts/setup.sh" >&2; exit 1; }

runs=${1:-5}
repeat=${2:-4}
work=$(mktemp -d /tmp/malleus-bench-prepare.XXXXXX)
trap 'rm -rf "$work"' EXIT
py=/usr/bin/python3

# The corpus: text for spm_encode, JSON Lines for prepare-data, the same documents.
"$py" - "$work" "$repeat" <<'EOF'
import glob, json, os, sys
work, repeat = sys.argv[1], int(sys.argv[2])
docs = []
for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
    if path.endswith((".dat", ".u8")) or not os.path.isfile(path):
        continue
    for doc in open(path, encoding="utf-8").read().split("\n%\n"):
        line = " ".join(doc.split())
        if line:
            docs.append(line)
with open(os.path.join(work, "corpus.txt"), "w", encoding="utf-8") as text, \
     open(os.path.join(work, "corpus.jsonl"), "w", encoding="utf-8") as jsonl:
    for _ in range(repeat):
        for line in docs:
            text.write(line + "\n")
            jsonl.write(json.dumps({"text": line}) + "\n")
EOF
zstd -q -c "$work/corpus.jsonl" > "$work/corpus.jsonl.zst"
split -n l/2 -d "$work/corpus.txt" "$work/half."
build/malleus train-tokenizer --input "$work/corpus.txt" --separator "" --vocab-size 8000 \
  --output "$work/tok.model" --threads "$(nproc)" > /dev/null
text_mb=$(stat -c %s "$work/corpus.txt" | awk '{printf "%.1f", $1 / 1e6}')
docs=$(wc -l < "$work/corpus.txt")

# seconds COMMAND...: the command's wall time and CPU time (user + system, its children's too).
seconds() {
  local TIMEFORMAT='%R %U %S' t
  t=$({ time "$@" > /dev/null 2>&1; } 2>&1)
  awk '{printf "%.3f/%.3f\n", $1, $2 + $3}' <<< "$t"
}
spm_one() { spm_encode --model "$work/tok.model" --output_format=id --extra_options=bos:eos \
  < "$work/corpus.txt" > "$work/spm.ids"; }
# Two spm_encode processes on the two halves: the reference at two cores.
spm_two() {
  for h in 00 01; do
    spm_encode --model "$work/tok.model" --output_format=id --extra_options=bos:eos \
      < "$work/half.$h" > "$work/spm.$h.ids" &
  done
  wait
}
prepare() {  # prepare INPUT THREADS
  build/malleus prepare-data --input "$work/$1" --tokenizer "$work/tok.model" --threads "$2" \
    --val-fraction 0 --progress-seconds 100000 --output "$work/out-$1-$2"
}

configs=("spm_encode, 1 process" "spm_encode, 2 processes on halves"
  "prepare-data jsonl, 1 thread" "prepare-data jsonl.zst, 1 thread"
  "prepare-data jsonl, 2 threads" "prepare-data jsonl.zst, 2 threads")
commands=("spm_one" "spm_two" "prepare corpus.jsonl 1" "prepare corpus.jsonl.zst 1"
  "prepare corpus.jsonl 2" "prepare corpus.jsonl.zst 2")
declare -A times
for ((r = 0; r < runs; r++)); do
  for i in "${!commands[@]}"; do
    # shellcheck disable=SC2086
    times[$i]+="$(seconds ${commands[$i]}) "
  done
done

# The ids: every prepare-data output against spm_encode's, document by document.
for out in "$work"/out-*; do
  "$py" - "$work/spm.ids" "$out" <<'EOF' || { echo "ids differ: $out" >&2; exit 1; }
import glob, struct, sys
spm = [int(t) for line in open(sys.argv[1]) for t in line.split()]
ours = []
for path in sorted(glob.glob(sys.argv[2] + "/train_*.bin")):
    data = open(path, "rb").read()
    count = struct.unpack_from("<i", data, 8)[0]
    ours.extend(struct.unpack_from("<%dH" % count, data, 1024))
if ours != spm:
    sys.exit("%s: %d ids, spm_encode %d" % (sys.argv[2], len(ours), len(spm)))
EOF
done
cat "$work/spm.00.ids" "$work/spm.01.ids" | cmp -s - "$work/spm.ids" ||
  { echo "spm_encode on halves differs from one process" >&2; exit 1; }

# median WALL|CPU I: the median of configuration I's wall (field 1) or CPU (field 2) times.
median() {
  # shellcheck disable=SC2086
  printf '%s\n' ${times[$2]} | cut -d/ -f"$1" | sort -g |
    awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'
}
{
  echo "bench_prepare_data.sh $runs $repeat on $(date -u +%Y-%m-%d) ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg) at the end):"
  echo "corpus: fortunes x $repeat, $docs documents, $text_mb MB of text; model: BPE, 8000 tokens"
  echo "ids of every prepare-data run equal spm_encode's; medians of $runs runs, wall and CPU (user + sys)"
  wall0=$(median 1 0)
  cpu0=$(median 2 0)
  for i in "${!configs[@]}"; do
    awk -v name="${configs[$i]}" -v w="$(median 1 "$i")" -v c="$(median 2 "$i")" -v mb="$text_mb" \
      -v w0="$wall0" -v c0="$cpu0" 'BEGIN {
        printf "  %-36s wall %6.2f s %6.2f MB/s %5.2fx | CPU %6.2f s %6.2f MB/s %5.2fx spm_encode\n",
               name, w, mb / w, w0 / w, c, mb / c, c0 / c}'
  done
}
