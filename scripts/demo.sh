#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the built-in demo: a temporary mount, a simulated
# multi-rank checkpoint storm, the drain to a temporary shared store, a summary, cleanup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ckptfs demo "$@"
