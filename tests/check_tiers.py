#!/usr/bin/env python3
"""Every CTest entry carries exactly one tier label (tests/CMakeLists.txt, CONTRIBUTING.md).

Usage: check_tiers.py BUILD_DIR. Reads `ctest --show-only=json-v1`; prints each test without a
tier, or with several, and exits 1 if there is any.
"""
import json
import subprocess
import sys

TIERS = {"unit", "slow", "mpi", "cli", "python", "timing", "cuda"}


def main() -> int:
    build = sys.argv[1]
    listing = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1"],
                             check=True, capture_output=True, text=True).stdout
    tests = json.loads(listing)["tests"]
    bad = []
    for test in tests:
        labels = []
        for prop in test.get("properties", []):
            if prop["name"] == "LABELS":
                labels = prop["value"]
        tiers = [label for label in labels if label in TIERS]
        if len(tiers) != 1:
            bad.append(f"{test['name']}: labels {labels}")
    for line in bad:
        print(f"check_tiers: {line} (give it one of {sorted(TIERS)})")
    if not tests:
        print("check_tiers: ctest lists no tests")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
