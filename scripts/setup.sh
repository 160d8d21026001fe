#!/usr/bin/env bash
# Installs what malleus needs from Debian's packages. Idempotent: installs only what is missing.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config
  libopenblas-openmp-dev  # BLAS (OpenMP build, sharing one thread pool with our kernels)
  libopenmpi-dev openmpi-bin  # the multi-rank runtime
  nlohmann-json3-dev libcli11-dev libxxhash-dev
  libsentencepiece-dev  # SentencePiece tokenizers (read, train; LLaMA-2's tokenizer.model format)
  zlib1g-dev liblzma-dev libzstd-dev  # prepare-data reads gzip, xz and zstd corpora
  gzip xz-utils zstd  # the tests compress their corpora with the command-line tools
  sentencepiece  # spm_encode: the tests' and bench/'s reference tokenization
  libgtest-dev libgmock-dev
  fortunes  # the default training corpus (plain-text English)
  python3 python3-numpy  # the independent Hugging Face reference used by the export test
  python3-dev pybind11-dev  # the Python package (python/): the pybind11 module over the libraries
  python3-torch  # malleus.torch, its tests, example and benchmark (Debian's PyTorch, CPU)
  python3-setuptools python3-pip python3-wheel python3-venv  # pip install --no-build-isolation .
  clang-format
  cpulimit  # slows a rank from outside malleus in straggler experiments (scripts/slow_rank.sh)
  iproute2  # network namespaces, veth links and tc shaping of the multi-host test bed (scripts/hosts.sh)
  slurm-wlm munge  # a Slurm cluster on this machine for the Slurm tests and examples/slurm (scripts/slurm.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "setup: all packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
  "${missing[@]}"
