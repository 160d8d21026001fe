#!/usr/bin/env bash
# A few lines the demo model writes before and after training (docs/demo.md): three
# samples from the model as training initialises it, then three from the run's last checkpoint.
# Each sample starts a new fortune (the prompt is empty) and ends at the end-of-text token.
# Usage: scripts/demo_samples.sh [RUN_DIR] (default runs/demo); run after scripts/demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/demo}
flags=(--tokenizer byte --max-tokens 200 --temperature 0.8 --top-k 40)
echo "=== before training (the demo model as initialised, seed 1234)"
for seed in 1 2 3; do
  build/malleus generate --untrained demo "${flags[@]}" --seed "$seed" 2> /dev/null
done
echo "=== after training ($run)"
for seed in 1 2 3; do
  build/malleus generate --checkpoint "$run" "${flags[@]}" --seed "$seed" 2> /dev/null
done
