#!/usr/bin/env bash
# Run xfstests (https://git.kernel.org/pub/scm/fs/xfs/xfstests-dev.git) against ckptfs mounts.
# Needs an xfstests checkout (not shipped here) with its build dependencies (Debian:
# xfslibs-dev uuid-dev libattr1-dev libacl1-dev libaio-dev libgdbm-dev liburing-dev, plus
# xfsprogs attr acl bc gawk psmisc at run time) and root.
#
#   bash scripts/xfstests.sh /path/to/xfstests [check args, default: -g quick]
#
# What it sets up, and removes again on exit:
# - /sbin/mount.fuse.ckptfs, so that `mount -t fuse.ckptfs DEV MNT` (what xfstests runs for
#   FSTYP=fuse, FUSE_SUBTYP=.ckptfs) mounts a ckptfs whose NVME and SHARED directories are
#   named after DEV under a scratch directory;
# - a config file passed as HOST_OPTIONS (TEST_DEV, SCRATCH_DEV and their mountpoints).
# xfstests recognises FUSE mounts by the type "fuse"; ckptfs mounts are "fuse.ckptfs", so the
# checkout's common/rc gets one sed rule that maps the one to the other (idempotent).
set -euo pipefail
src=$(realpath "${1:?usage: xfstests.sh XFSTESTS_CHECKOUT [check args]}")
shift
cd "$(dirname "$0")/.."
[ -x .venv/bin/ckptfs ] || bash scripts/setup.sh
ckptfs=$(realpath .venv/bin/ckptfs)
helper=/sbin/mount.fuse.ckptfs
if [ -e "$helper" ]; then
    echo "ckptfs: error: $helper exists; remove it or run xfstests by hand" >&2
    exit 1
fi
if [ ! -x "$src/ltp/fsx" ]; then
    make -C "$src" -j"$(nproc)"
fi
grep -q 's/fuse.ckptfs/fuse/' "$src/common/rc" ||
    sed -i "s#-e 's/fuse.ceph-fuse/ceph-fuse/'#& -e 's/fuse.ckptfs/fuse/'#" "$src/common/rc"
id fsgqa >/dev/null 2>&1 || useradd -m fsgqa

work=$(mktemp -d /tmp/ckptfs-xfstests.XXXXXX)
mkdir -p "$work/test" "$work/scratch" "$work/dev"
chmod 0755 "$work"  # the suite runs commands as fsgqa below it
cleanup() {
    cd /
    for m in "$work/test" "$work/scratch"; do
        if grep -q " $m fuse.ckptfs " /proc/mounts; then
            "$ckptfs" umount --no-drain "$m" >/dev/null 2>&1 || umount -l "$m" || true
        fi
    done
    rm -f "$helper"
    rm -rf "$work"
}
trap cleanup EXIT
cat > "$helper" <<EOF
#!/bin/sh
# mount -t fuse.ckptfs DEV MNT [-o options]: a ckptfs for xfstests (scripts/xfstests.sh)
case "\$*" in
*remount*) exec mount -i "\$@" ;;  # ro/rw: the kernel flips the flag, as mount.ckptfs does
esac
mkdir -p "$work/dev/\$1/nvme" "$work/dev/\$1/shared"
exec "$ckptfs" mount --fsname "\$1" --allow-other --log-level warning \\
    "$work/dev/\$1/nvme" "$work/dev/\$1/shared" "\$2" >/dev/null
EOF
chmod +x "$helper"
cat > "$work/local.config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.ckptfs
export TEST_DEV=ckptfs-test
export TEST_DIR=$work/test
export SCRATCH_DEV=ckptfs-scratch
export SCRATCH_MNT=$work/scratch
EOF
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-g quick)
cd "$src"
HOST_OPTIONS="$work/local.config" ./check "${args[@]}"
