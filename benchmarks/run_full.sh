#!/usr/bin/env bash
# The full benchmark matrix on the v2lite-2L preset: six engines x ctx 128/1k/4k/16k x batch 1/8.
# Builds the preset checkpoint and exports in benchmarks/work/ on first use (about 2-3 minutes,
# 17 GB of disk), then writes benchmarks/results/results.json and results.png.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$root"
mla-deploy bench --out benchmarks/results "$@"
