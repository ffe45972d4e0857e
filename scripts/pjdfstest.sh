#!/usr/bin/env bash
# Run the pjdfstest POSIX conformance suite (https://github.com/pjd/pjdfstest) against a
# scratch ckptfs mount. Needs a pjdfstest checkout (not shipped here), autoconf, automake, a C
# compiler and perl's `prove`; runs as root (the suite switches users, hence --allow-other).
#
#   bash scripts/pjdfstest.sh /path/to/pjdfstest [prove args, e.g. tests/chmod]
#
# Builds pjdfstest in place if needed; the mount and its scratch directories are removed on exit.
set -euo pipefail
src=$(realpath "${1:?usage: pjdfstest.sh PJDFSTEST_CHECKOUT [TEST_DIR...]}")
shift
cd "$(dirname "$0")/.."
[ -x .venv/bin/ckptfs ] || bash scripts/setup.sh
if [ ! -x "$src/pjdfstest" ]; then
    (cd "$src" && autoreconf -ifs && ./configure && make)
fi
ckptfs=$(realpath .venv/bin/ckptfs)
work=$(mktemp -d /tmp/ckptfs-pjdfstest.XXXXXX)
mkdir "$work/nvme" "$work/shared" "$work/mnt"
cleanup() {
    cd /
    "$ckptfs" umount "$work/mnt" >/dev/null 2>&1 || fusermount3 -u "$work/mnt" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
"$ckptfs" mount --allow-other "$work/nvme" "$work/shared" "$work/mnt"
chmod 0755 "$work"
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=("$src/tests")
cd "$work/mnt"
prove -r "${tests[@]/#tests/$src/tests}"
