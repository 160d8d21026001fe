#!/usr/bin/env bash
# The main job on its built-in default: set up, build, prepare the fortunes corpus, train the demo
# model. Extra arguments go to `malleus train` (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
if ! compgen -G "data/fortunes/train_*.bin" > /dev/null; then
  build/malleus prepare-data
fi
exec build/malleus train "$@"
