#!/usr/bin/env bash
# Set up, build (warnings are errors) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh -DMALLEUS_WERROR=ON
ctest --test-dir build --output-on-failure --timeout 900 -j "$(nproc)"
