#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the built-in demo: a temporary mount, a simulated
# multi-rank checkpoint storm, the drain to a temporary shared store, a summary, cleanup.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) if [ -x .venv/bin/ckptfs ]; then exec .venv/bin/ckptfs demo --help; fi
             echo "usage: bash scripts/demo.sh [ckptfs demo options]  (sets up .venv first;"
             echo "       then see: .venv/bin/ckptfs demo --help)"; exit 0 ;;
esac
bash scripts/setup.sh
exec .venv/bin/ckptfs demo "$@"
