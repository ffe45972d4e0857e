#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite. Long stress runs: add `-m slow`.
#
# With no arguments: the tests mostly wait on daemons, timers and disks, so two pytest-xdist
# workers share the machine's two CPUs (CKPTFS_TEST_WORKERS=0: one after another), each file's
# tests on one worker (`--dist loadfile`: tests/test_s3.py's S3 server has fixed ports). Tests
# marked `serial` (the power-loss model, which a sync() or writeback caused by another test
# would defeat) then run alone. With arguments: one plain pytest run with them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
if [ $# -gt 0 ]; then
    exec $py -m pytest "$@"
fi
rc=0
$py -m pytest -n "${CKPTFS_TEST_WORKERS:-2}" --dist loadfile -m "not slow and not serial" || rc=$?
$py -m pytest -m "not slow and serial" || rc=$((rc ? rc : $?))
exit "$rc"
