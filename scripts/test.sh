#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Long stress runs: add `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
